"""Qwen3-VL-MoE expert tensors in, expert tensors out: the family's checkpoint adapter
(spindle/models/shared/moe_checkpoints.py). Qwen3-VL-MoE's released checkpoints hold each layer's experts
fused and transposed (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`; transformers transposes them on
load), transformers 5.23's `save_pretrained` writes them fused in the model's orientation, and per-expert
checkpoints (`experts.{j}.gate_proj.weight` ..., converted or quantised ones) exist too: all three load,
and an export writes the one its input had."""

from __future__ import annotations

from spindle.models.shared.moe_checkpoints import FUSED, ExpertCheckpoints

ADAPTER = ExpertCheckpoints(
    model_type="qwen3_vl_moe", default_layout=FUSED, transposed_fused=True, layers_prefix="model.language_model.layers"
)
