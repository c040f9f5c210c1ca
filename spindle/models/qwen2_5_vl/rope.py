"""Qwen2.5-VL's 3-D RoPE positions of one document: transformers' `Qwen2_5_VLModel.get_rope_index`."""

from __future__ import annotations

from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

from spindle.models.shared.vlm_rope import rope_for

rope_index = rope_for(Qwen2_5_VLModel, seconds=True)
