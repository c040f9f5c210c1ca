"""Qwen3-VL's 3-D RoPE positions of one document: transformers' `Qwen3VLModel.get_rope_index`
(video frames spaced by timestamps in the text, so second_per_grid_ts is ignored)."""

from __future__ import annotations

from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from spindle.models.shared.vlm_rope import rope_for

rope_index = rope_for(Qwen3VLModel, seconds=False)
