"""Qwen2.5-Omni's 3-D RoPE positions of one document: the thinker's own `get_rope_index` (audio spans
included), run without building the model."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniPreTrainedModelForConditionalGeneration

# what get_rope_index reads besides the config
_METHODS = ("get_rope_index", "get_llm_pos_ids_for_vision", "get_chunked_index")


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
    audio_seqlens: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> torch.Tensor:
    """[1, L] token ids of one document -> its [3, 1, L] positions. `audio_seqlens`: each audio clip's mel
    frame count, in token order; `use_audio_in_video`: each video is followed by its audio track, interleaved
    (then every video must have one). (With no image or video the positions are 0..L-1: audio spans are 1-D.)"""
    return thinker_rope_index(
        Qwen2_5OmniPreTrainedModelForConditionalGeneration,
        config,
        input_ids,
        image_grid_thw,
        video_grid_thw,
        second_per_grid_ts,
        audio_seqlens,
        use_audio_in_video,
    )


def thinker_rope_index(
    cls: type,
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    audio_seqlens: torch.Tensor | None,
    use_audio_in_video: bool,
) -> torch.Tensor:
    """`rope_index` by the `get_rope_index` of `cls`, an omni thinker's pre-trained base class (Qwen2.5-Omni's,
    Qwen3-Omni-MoE's: the same method names), on a stand-in holding only what the method reads."""
    stand_in = type("RopeIndexer", (), {name: getattr(cls, name) for name in _METHODS})()
    stand_in.config = config
    stand_in.spatial_merge_size = config.vision_config.spatial_merge_size
    positions, _ = stand_in.get_rope_index(
        input_ids,
        image_grid_thw,
        video_grid_thw,
        torch.ones_like(input_ids),
        use_audio_in_video=use_audio_in_video,
        audio_seqlens=audio_seqlens,
        second_per_grids=second_per_grid_ts,
    )
    out: torch.Tensor = positions
    return out
