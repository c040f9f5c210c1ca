"""Preference pairs whose prompts carry images, videos or audio, for vision-language and omni families.

The lines are `spindle.data.preference`'s (TRL's formats: explicit or implicit prompt), conversational, with
the prompt's messages holding content parts as conversations for supervised training do
(`spindle.data.multimodal`: `{"type": "image", "image": PATH}`, `image_url`, `video`, `audio`; paths relative
to the JSONL file); the completions are text (an assistant message's string content):

    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "cat.png"},
                                             {"type": "text", "text": "What animal is this?"}]}],
     "chosen": [{"role": "assistant", "content": "A cat."}],
     "rejected": [{"role": "assistant", "content": "A dog."}]}

Tokenisation is the text rule (`tokenize_preference`: the prompt rendered with the generation prompt, the
prompt followed by each completion rendered whole, the completions where those stop agreeing) on the model's
processor side: the chat template with each media placeholder expanded to its input's token count, as the
stock processor does (`VisionProcessor.render`). So `prompt_ids + chosen_ids` is exactly what the stock
processor makes of the prompt-and-chosen conversation. A batch (`collate_media_pairs`) is `collate_pairs`'s
rows with each row's multimodal RoPE positions (the family's `rope_index` on the whole row) and the pairs' media
twice, for the chosen rows and then the rejected rows, in token order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spindle.data.multimodal import (
    VisionProcessor,
    collate_vision,
    is_data_url,
    media_parts,
    normalise_conversation,
)
from spindle.data.preference import (
    PairTokenizer,
    PreferencePair,
    collate_pairs,
    common_prefix_length,
    is_conversation,
)


def media_pair_tokenizer(processor: VisionProcessor) -> PairTokenizer:
    """`spindle.data.preference.preference_pairs`'s tokenisation for a vision-language / omni model."""

    def tokenize(example: dict[str, Any], file: Path) -> tuple[list[int], list[int], list[int], list[Any]]:
        prompt = example["prompt"]
        if not is_conversation(prompt):
            raise ValueError(
                "a vision-language model's pairs are conversations: give the prompt and completions as message lists"
            )
        with_chosen = normalise_conversation({"messages": prompt + example["chosen"]})
        with_rejected = normalise_conversation({"messages": prompt + example["rejected"]})
        messages = with_chosen[: len(prompt)]
        for name, whole in (("chosen", with_chosen), ("rejected", with_rejected)):
            if media_parts(whole[len(prompt) :]):
                raise ValueError(f'"{name}" holds an image/video/audio part; media belong in the prompt')
        media = [processor.media(kind, p if is_data_url(p) else file.parent / p) for kind, p in media_parts(messages)]
        prompt_ids = processor.render(messages, media, True)
        chosen = processor.render(with_chosen, media, False)
        rejected = processor.render(with_rejected, media, False)
        split = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
        expected = sum(processor.tokens(media))
        if sum(t in processor.media_ids for t in prompt_ids[:split]) != expected:
            raise ValueError("the chat template did not place one pad token per image/video/audio part")
        return prompt_ids[:split], chosen[split:], rejected[split:], media

    return tokenize


def collate_media_pairs(
    pairs: list[PreferencePair], processor: VisionProcessor, pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """`collate_pairs`'s [2B, L] rows (B chosen, then B rejected) with `position_ids` [4, 2B, L] (row 0 the text
    positions, rows 1-3 the family's multimodal RoPE positions; padding continues them, as
    `spindle.data.multimodal.row_tensors` does) and the media inputs of every row in row-major token order."""
    out = collate_pairs(pairs, pad_id, multiple)
    width = out["input_ids"].shape[1]
    rows = [(p, p.chosen_ids) for p in pairs] + [(p, p.rejected_ids) for p in pairs]
    rope = []
    for pair, completion in rows:
        positions = processor.positions(pair.prompt_ids + completion, pair.media)
        pad = width - positions.shape[1]
        rope.append(torch.cat([positions, positions.max() + 1 + torch.arange(pad).expand(3, pad)], dim=1))
    out["position_ids"] = torch.cat([out["position_ids"][None], torch.stack(rope, dim=1)])
    out.update(collate_vision([m for pair, _ in rows for m in pair.media]))
    return out
