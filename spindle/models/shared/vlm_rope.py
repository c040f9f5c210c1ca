"""A VLM's multimodal (3-D) RoPE positions of one document, computed by transformers' own code (the
model class's `get_rope_index`) without building the model: the data path needs them per document
before any model exists, and a reimplementation could drift from the model's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """text 0, image 1, video 2 per token (what the Qwen-VL processors return as `mm_token_type_ids`)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


def model_rope_index(
    model_cls: Any,
    config: Any,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, L] token ids of one document -> its [3, 1, L] (temporal, height, width) positions, by
    `model_cls.get_rope_index` run on a stand-in holding just what it reads (the config and
    `get_vision_position_ids`)."""
    stand_in = type(
        "RopeIndexer",
        (),
        {"get_rope_index": model_cls.get_rope_index, "get_vision_position_ids": model_cls.get_vision_position_ids},
    )()
    stand_in.config = config
    extra = {} if second_per_grid_ts is None else {"second_per_grid_ts": second_per_grid_ts}
    positions, _ = stand_in.get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_types(config, input_ids),
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        **extra,
    )
    out: torch.Tensor = positions
    return out


RopeIndex = Callable[..., torch.Tensor]


def rope_for(model_cls: Any, seconds: bool) -> RopeIndex:
    """A family's `rope_index(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts=None)`:
    [1, L] token ids of one document -> its [3, 1, L] (temporal, height, width) positions, by `model_cls`'s
    own `get_rope_index`. `seconds`: the model spaces video frames by `second_per_grid_ts` (Qwen2.5-VL);
    otherwise it ignores them (Qwen3-VL writes timestamps into the text)."""

    def rope_index(
        config: Any,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        second_per_grid_ts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        spacing = second_per_grid_ts if seconds else None
        return model_rope_index(model_cls, config, input_ids, image_grid_thw, video_grid_thw, spacing)

    return rope_index
