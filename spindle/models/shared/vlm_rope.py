"""A VLM's multimodal (3-D) RoPE positions of one document, computed by transformers' own code (the
model class's `get_rope_index`) without building the model: the data path needs them per document
before any model exists, and a reimplementation could drift from the model's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def mm_token_types(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """text 0, image 1, video 2 per token (what the Qwen-VL processors return as `mm_token_type_ids`)."""
    types = torch.zeros_like(input_ids, dtype=torch.int32)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    return types


RopeIndex = Callable[..., Tensor]
Grid = Tensor | None  # [N, 3] (t, h, w) patch grids of a document's images or videos, or their seconds per grid


def _stand_in(model_cls: Any, methods: tuple[str, ...], config: Any) -> Any:
    """An object holding `model_cls`'s `methods` and `config`: what get_rope_index reads of the model."""
    stand_in = type("RopeIndexer", (), {name: getattr(model_cls, name) for name in methods})()
    stand_in.config = config
    return stand_in


def rope_for(model_cls: Any, seconds: bool) -> RopeIndex:
    """A VLM family's `rope_index(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts=None)`:
    [1, L] token ids of one document -> its [3, 1, L] (temporal, height, width) positions, by `model_cls`'s
    own `get_rope_index`. `seconds`: the model spaces video frames by `second_per_grid_ts` (Qwen2.5-VL);
    otherwise it ignores them (Qwen3-VL writes timestamps into the text)."""

    def rope_index(
        config: Any, input_ids: Tensor, image_grid_thw: Grid, video_grid_thw: Grid, second_per_grid_ts: Grid = None
    ) -> Tensor:
        stand_in = _stand_in(model_cls, ("get_rope_index", "get_vision_position_ids"), config)
        extra = {"second_per_grid_ts": second_per_grid_ts} if seconds and second_per_grid_ts is not None else {}
        positions, _ = stand_in.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_types(config, input_ids),
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            **extra,
        )
        out: torch.Tensor = positions
        return out

    return rope_index


def thinker_rope_for(thinker_cls: Any) -> RopeIndex:
    """An omni family's `rope_index(config, input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts=None,
    audio_seqlens=None, use_audio_in_video=False)`: [1, L] token ids of one document -> its [3, 1, L] positions,
    by the `get_rope_index` of `thinker_cls`, the thinker's pre-trained base class (Qwen2.5-Omni's,
    Qwen3-Omni-MoE's: the same method names). `audio_seqlens`: each audio clip's mel frame count, in token
    order; `use_audio_in_video`: each video is followed by its audio track, interleaved (then every video must
    have one). (With no image or video the positions are 0..L-1: audio spans are 1-D.)"""

    def rope_index(
        config: Any,
        input_ids: torch.Tensor,
        image_grid_thw: torch.Tensor | None,
        video_grid_thw: torch.Tensor | None,
        second_per_grid_ts: torch.Tensor | None = None,
        audio_seqlens: torch.Tensor | None = None,
        use_audio_in_video: bool = False,
    ) -> torch.Tensor:
        methods = ("get_rope_index", "get_llm_pos_ids_for_vision", "get_chunked_index")
        stand_in = _stand_in(thinker_cls, methods, config)
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

    return rope_index
