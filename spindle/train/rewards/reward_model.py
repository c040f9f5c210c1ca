"""A reward-model folder as a language model's reward: a transformers AutoModelForSequenceClassification with
one label (what `train.objective: reward` exports, or any such checkpoint) scoring each prompt + completion.

As TRL scores them: standard prompts and completions (strings) as their concatenation; conversational ones (message
lists) as the folder tokenizer's chat template over the prompt's messages followed by the completion's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from spindle.config import ConfigError


class RewardModel:
    def __init__(self, folder: str, batch_size: int, device: torch.device) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(folder).expanduser()
        config = path / "config.json"
        if not config.is_file():
            raise ConfigError(f"reward model {folder}: no config.json there; give a transformers model folder")
        labels = json.loads(config.read_text()).get("id2label")
        if labels is not None and len(labels) != 1:
            raise ConfigError(
                f"reward model {folder} has {len(labels)} labels; a reward model has one (num_labels: 1, a scalar "
                "score), as AutoModelForSequenceClassification(num_labels=1) saves it"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).to(device).eval()
        if self.model.config.pad_token_id is None:  # the head pools at the last token that is not padding
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.device = device

    def text(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion
        if isinstance(prompt, list) and isinstance(completion, list):
            media = sorted({part.get("type") for m in prompt if isinstance(m.get("content"), list) for part in m["content"]}
                           - {"text"})  # fmt: skip
            if media:  # the tokenizer's template would drop them: a score of the text alone, silently
                raise ValueError(
                    f"a reward-model folder scores text only, and this prompt carries {', '.join(map(str, media))} "
                    "parts; score such prompts with a reward function (`path/to/file.py:function`, given the prompt "
                    "messages) or train on text prompts"
                )
            text: str = self.tokenizer.apply_chat_template(prompt + completion, tokenize=False)
            return text
        raise TypeError(
            f"a reward model scores a string prompt + completion or two message lists; got {type(prompt).__name__} "
            f"and {type(completion).__name__}"
        )

    @torch.no_grad()
    def __call__(
        self, completions: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
    ) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(
                texts[start : start + self.batch_size],
                padding=True,
                padding_side="right",
                add_special_tokens=False,
                return_tensors="pt",
            ).to(self.device)
            logits = self.model(**batch).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
