"""A tiny random Qwen3-VL-MoE in the transformers layout (`spindle tiny-model qwen3_vl_moe`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.qwen3_vl.tiny import TINY_TEXT, TINY_VISION, build_qwen3_vl_like

# Qwen3-VL-30B-A3B's structure, scaled down: the tiny Qwen3-VL with every decoder layer sparse, 8 experts,
# top-2. moe_intermediate_size keeps 2I and I apart from hidden_size: transformers decides whether to
# transpose a fused expert tensor on load by comparing shapes, so a square one would load untransposed.
# An aux coefficient of 0.1 makes a wrong aux loss show in the step loss.
TINY_MOE = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, router_aux_loss_coef=0.1, decoder_sparse_step=1
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Saved by stock save_pretrained: the fused, transposed expert layout of Qwen's checkpoints.
    return build_qwen3_vl_like("qwen3_vl_moe", out, {**TINY_TEXT, **TINY_MOE}, TINY_VISION, seed, transformer)
