"""Qwen3.5-MoE's 3-D RoPE positions of one document: transformers' `Qwen3_5MoeModel.get_rope_index` (as
Qwen3.5's: second_per_grid_ts unused)."""

from __future__ import annotations

from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel

from spindle.models.shared.vlm_rope import rope_for

rope_index = rope_for(Qwen3_5MoeModel, seconds=False)
