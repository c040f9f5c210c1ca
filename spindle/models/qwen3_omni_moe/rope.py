"""Qwen3-Omni-MoE's 3-D RoPE positions of one document: the thinker's own `get_rope_index` (audio spans and
audio-in-video interleaving included), run without building the model."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration,
)

from spindle.models.qwen2_5_omni.rope import thinker_rope_index


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
    audio_seqlens: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> torch.Tensor:
    """As spindle.models.qwen2_5_omni.rope.rope_index, by Qwen3-Omni-MoE's method (its audio token counts
    follow the audio encoder's `n_window` chunks)."""
    return thinker_rope_index(
        Qwen3OmniMoePreTrainedModelForConditionalGeneration,
        config,
        input_ids,
        image_grid_thw,
        video_grid_thw,
        second_per_grid_ts,
        audio_seqlens,
        use_audio_in_video,
    )


def audio_tokens(config: Any, frames: int) -> int:
    """How many decoder tokens the audio encoder makes of `frames` mel frames (13 per full `n_window * 2`-frame
    chunk, the rest through its three stride-2 convolutions): the model's `_get_feat_extract_output_lengths`."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), config.audio_config.n_window))
