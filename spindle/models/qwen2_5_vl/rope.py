"""Qwen2.5-VL's multimodal (3-D) RoPE positions of one document, computed by transformers' own code
(`Qwen2_5_VLModel.get_rope_index`) without building the model: the data path needs them per document
before any model exists, and a reimplementation could drift from the model's."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel


class _RopeIndexer:
    """Just what `get_rope_index` reads from its model: the config and `get_vision_position_ids`."""

    get_rope_index = Qwen2_5_VLModel.get_rope_index
    get_vision_position_ids = Qwen2_5_VLModel.get_vision_position_ids

    def __init__(self, config: Any):
        self.config = config


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """text 0, image 1, video 2 per token (what the Qwen-VL processor returns as `mm_token_type_ids`)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def rope_index(
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, L] token ids of one document -> its [3, 1, L] (temporal, height, width) positions."""
    positions, _ = _RopeIndexer(config).get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_types(config, input_ids),
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts,
    )
    out: torch.Tensor = positions
    return out
