"""Qwen2.5-VL's 3-D RoPE positions of one document: transformers' `Qwen2_5_VLModel.get_rope_index`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

from spindle.models.shared.vlm_rope import model_rope_index


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, L] token ids of one document -> its [3, 1, L] (temporal, height, width) positions."""
    return model_rope_index(Qwen2_5_VLModel, config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts)
