"""Qwen2.5-Omni's placeholder text of a video with its audio track (`use_audio_in_video`): the stock
processor's own `replace_video_with_audio_token`, run on a stand-in holding what it reads. Frames and audio
tokens alternate in chunks of `seconds_per_chunk` (by the frames' and the clip's temporal positions),
between `<|audio_bos|>` and `<|audio_eos|>`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor


def video_audio_placeholder(
    config: Any, tokenizer: Any, grid_thw: torch.Tensor, second_per_grid: float, audio_tokens: int, merge_size: int
) -> str:
    stand_in = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=merge_size),
        audio_bos_token=tokenizer.convert_ids_to_tokens(config.audio_start_token_id),
        audio_eos_token=tokenizer.convert_ids_to_tokens(config.audio_end_token_id),
        video_token=tokenizer.convert_ids_to_tokens(config.video_token_id),
        audio_token=tokenizer.convert_ids_to_tokens(config.audio_token_id),
    )
    stand_in.get_chunked_index = lambda indices, per_chunk: Qwen2_5OmniProcessor.get_chunked_index(
        stand_in, indices, per_chunk
    )
    text: str = Qwen2_5OmniProcessor.replace_video_with_audio_token(
        stand_in,
        {"video_grid_thw": [grid_thw.tolist()], "video_second_per_grid": [second_per_grid]},
        0,
        {"num_audio_tokens": [audio_tokens]},
        0,
        position_id_per_seconds=config.position_id_per_seconds,
        seconds_per_chunk=config.seconds_per_chunk,
    )
    return text
