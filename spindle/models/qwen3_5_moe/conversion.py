"""Qwen3.5-MoE expert tensors in, expert tensors out: the family's checkpoint adapter
(spindle/models/shared/moe_checkpoints.py). The model holds each layer's routed experts fused (`gate_up_proj
[E, 2I, H]`); its checkpoints hold them per expert (`experts.{j}.gate_proj.weight` ...: what transformers'
conversion mapping reads and its `save_pretrained` writes back), fused ones load too, and an export writes the
layout its input had. The shared expert (`mlp.shared_expert.*`, gated) is a plain MLP outside the experts."""

from __future__ import annotations

from spindle.models.shared.moe_checkpoints import PER_EXPERT, ExpertCheckpoints

ADAPTER = ExpertCheckpoints(
    model_type="qwen3_5_moe", default_layout=PER_EXPERT, layers_prefix="model.language_model.layers"
)
