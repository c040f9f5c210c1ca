"""Qwen3-VL-MoE's 3-D RoPE positions of one document: transformers' `Qwen3VLMoeModel.get_rope_index`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

from spindle.models.shared.vlm_rope import model_rope_index


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, L] token ids of one document -> its [3, 1, L] positions (as Qwen3-VL: second_per_grid_ts unused)."""
    return model_rope_index(Qwen3VLMoeModel, config, input_ids, image_grid_thw, video_grid_thw)
