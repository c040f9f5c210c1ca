"""Qwen3-VL-MoE's 3-D RoPE positions of one document: transformers' `Qwen3VLMoeModel.get_rope_index`
(as Qwen3-VL: second_per_grid_ts unused)."""

from __future__ import annotations

from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

from spindle.models.shared.vlm_rope import rope_for

rope_index = rope_for(Qwen3VLMoeModel, seconds=False)
