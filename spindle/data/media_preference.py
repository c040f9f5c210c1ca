"""Preference pairs and prompts whose prompts carry images, videos or audio, for vision-language and omni families
(DPO's pairs, GRPO's prompts and the rows of their completions).

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

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spindle.data.multimodal import (
    VisionProcessor,
    collate_vision,
    continued,
    media_parts,
    model_positions,
    normalise_conversation,
)
from spindle.data.preference import (
    PairTokenizer,
    PreferencePair,
    PromptTokenizer,
    collate_pairs,
    collate_sequences,
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
        media = processor.load_media(messages, file.parent)
        prompt_ids = processor.render(messages, media, True)
        chosen = processor.render(with_chosen, media, False)
        rejected = processor.render(with_rejected, media, False)
        split = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
        processor.check_placeholders(prompt_ids[:split], media)
        return prompt_ids[:split], chosen[split:], rejected[split:], media

    return tokenize


def collate_media_pairs(
    pairs: list[PreferencePair], processor: VisionProcessor, pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """`collate_pairs`'s [2B, L] rows (B chosen, then B rejected) as `media_rows` completes them."""
    rows = [(p.prompt_ids, p.chosen_ids, p.media) for p in pairs]
    rows += [(p.prompt_ids, p.rejected_ids, p.media) for p in pairs]
    return media_rows(collate_pairs(pairs, pad_id, multiple), rows, processor)


def collate_media_sequences(
    rows: list[tuple[list[int], list[int], list[Any]]], processor: VisionProcessor, pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """(prompt ids, completion ids, the prompt's media) rows -> `collate_sequences`'s batch as `media_rows`
    completes it (GRPO's completions of vision-language prompts)."""
    batch = collate_sequences([(prompt, completion) for prompt, completion, _ in rows], pad_id, multiple)
    return media_rows(batch, rows, processor)


def media_rows(
    batch: dict[str, torch.Tensor], rows: list[tuple[list[int], list[int], list[Any]]], processor: VisionProcessor
) -> dict[str, torch.Tensor]:
    """A right-padded text batch of `rows` with `position_ids` [4, N, L] (row 0 the text positions, rows 1-3 the
    family's multimodal RoPE positions of each whole row; padding continues them, as
    `spindle.data.multimodal.row_tensors` does; [N, L] text positions for a model with 1-D positions) and the
    rows' media inputs in row-major token order."""
    width = batch["input_ids"].shape[1]
    rope = []
    for prompt, completion, media in rows:
        positions = processor.positions(prompt + completion, media)
        pad = width - positions.shape[1]
        rope.append(continued(positions, pad))
    batch["position_ids"] = model_positions(torch.cat([batch["position_ids"][None], torch.stack(rope, dim=1)]))
    batch.update(collate_vision([m for _, _, media in rows for m in media]))
    return batch


def media_prompt_tokenizer(processor: VisionProcessor) -> PromptTokenizer:
    """`spindle.data.preference.read_prompts`'s tokenisation for a vision-language / omni model: the prompt's
    messages (content parts as for pairs) rendered with the generation prompt, placeholders expanded."""

    def tokenize(prompt: Any, file: Path) -> tuple[list[int], list[Any]]:
        if not is_conversation(prompt):
            raise ValueError("a vision-language model's prompts are conversations: give the prompt as a message list")
        # normalised as a conversation (which needs an assistant turn to learn) less that turn
        messages = normalise_conversation({"messages": [*prompt, {"role": "assistant", "content": "-"}]})[:-1]
        media = processor.load_media(messages, file.parent)
        ids = processor.render(messages, media, True)
        processor.check_placeholders(ids, media)
        return ids, media

    return tokenize


def prompt_step_inputs(
    processor: VisionProcessor, prompt_ids: list[int], media: list[Any], rows: int, device: torch.device
) -> Callable[[int], dict[str, Any]]:
    """The keyword arguments of each generation step of `rows` completions of one prompt
    (`spindle.train.generation.sample_group`'s `step_inputs`): step 0 the prompt's media (once per row) and its
    [4, rows, P] positions; step t the [4, rows, 1] positions of the t-th new token, one past the prompt's in every
    RoPE dimension (text after the media advances all three alike)."""
    positions = processor.positions(prompt_ids, media)  # [R, P]
    first = torch.cat([torch.arange(len(prompt_ids))[None], positions])  # [1 + R, P]
    media_inputs = collate_vision([m for _ in range(rows) for m in media])
    after = torch.tensor([len(prompt_ids), *([int(positions.max()) + 1] * len(positions) if len(positions) else [])])
    axes = len(after)

    def step(t: int) -> dict[str, Any]:
        if t == 0:
            return {
                "position_ids": model_positions(first[:, None].expand(axes, rows, -1)).to(device),
                **{k: v.to(device) for k, v in media_inputs.items()},
            }
        return {"position_ids": model_positions((after + t - 1)[:, None, None].expand(axes, rows, 1)).to(device)}

    return step
