"""Qwen3-MoE expert tensors in, expert tensors out: the family's checkpoint adapter
(spindle/models/shared/moe_checkpoints.py). Qwen3-MoE's released checkpoints and its stock
`save_pretrained` hold the experts per expert (`experts.{j}.gate_proj.weight [I, H]` ...); its fused
layout is the model's own (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)."""

from __future__ import annotations

from spindle.models.shared.moe_checkpoints import FUSED, PER_EXPERT, ExpertCheckpoints

ADAPTER = ExpertCheckpoints(model_type="qwen3_moe", default_layout=PER_EXPERT)

# what tests/train/test_moe.py checks by name
expert_layout = ADAPTER.layout
to_layout = ADAPTER.to_layout
__all__ = ["ADAPTER", "FUSED", "PER_EXPERT", "expert_layout", "to_layout"]
