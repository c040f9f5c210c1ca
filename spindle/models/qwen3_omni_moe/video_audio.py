"""Qwen3-Omni-MoE's placeholder text of a video with its audio track (`use_audio_in_video`): the stock
processor's own `replace_video_with_audio_token`, run on a stand-in holding what it reads. Each temporal grid
of frames goes at its start time and the audio tokens (one position each) fill the time up to the next, all
between `<|audio_start|>` and `<|audio_end|>` (the tokenizer's `audio_bos_token` / `audio_eos_token`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor


def video_audio_placeholder(
    config: Any, tokenizer: Any, grid_thw: torch.Tensor, second_per_grid: float, audio_tokens: int, merge_size: int
) -> str:
    stand_in = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=merge_size),
        audio_bos_token=tokenizer.audio_bos_token,
        audio_eos_token=tokenizer.audio_eos_token,
        video_token=tokenizer.convert_ids_to_tokens(config.video_token_id),
        audio_token=tokenizer.convert_ids_to_tokens(config.audio_token_id),
    )
    text: str = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        stand_in,
        {"video_grid_thw": [grid_thw.tolist()], "video_second_per_grid": [second_per_grid]},
        0,
        {"num_audio_tokens": [audio_tokens]},
        0,
        position_id_per_seconds=config.position_id_per_seconds,
    )
    return text
