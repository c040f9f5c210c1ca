"""Qwen3.5's 3-D RoPE positions of one document: transformers' `Qwen3_5Model.get_rope_index` (video frames
spaced by timestamps in the text, as Qwen3-VL's, so second_per_grid_ts is ignored)."""

from __future__ import annotations

from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from spindle.models.shared.vlm_rope import rope_for

rope_index = rope_for(Qwen3_5Model, seconds=False)
