"""A tiny random Qwen3.5-MoE in the transformers layout (`spindle tiny-model qwen3_5_moe`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.qwen3_5.tiny import TINY_TEXT, TINY_VISION
from spindle.models.qwen3_vl.tiny import build_qwen3_vl_like

# Qwen3.5-MoE's structure, scaled down: the tiny Qwen3.5 with a sparse MoE in every layer, 8 experts, top-2,
# and a gated shared expert. moe_intermediate_size keeps 2I and I apart from hidden_size (a square fused tensor
# would be ambiguous in orientation); an aux coefficient of 0.1 makes a wrong aux loss show in the step loss.
TINY_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=48,
    router_aux_loss_coef=0.1,
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Saved by stock save_pretrained: per-expert tensors (transformers' conversion mapping writes them back so)
    text = {k: v for k, v in TINY_TEXT.items() if k != "intermediate_size"}  # every layer sparse
    return build_qwen3_vl_like("qwen3_5_moe", out, {**text, **TINY_MOE}, TINY_VISION, seed, transformer)
