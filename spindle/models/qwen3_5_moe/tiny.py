"""A tiny random Qwen3.5-MoE in the transformers layout (`spindle tiny-model qwen3_5_moe`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.qwen3_5.tiny import TINY_TEXT, TINY_VISION
from spindle.models.qwen3_vl.tiny import PROCESSOR, VIDEO_PROCESSOR
from spindle.models.shared.tiny_vlm import QWEN3_VL_CHAT_TEMPLATE, build_tiny_vlm

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
    over = dict(transformer or {})
    text = {k: v for k, v in TINY_TEXT.items() if k != "intermediate_size"}
    text = {**text, **TINY_MOE, **over.pop("text_config", {})}
    return build_tiny_vlm(
        "qwen3_5_moe",
        out,
        text,
        TINY_VISION,
        seed=seed,
        transformer={**over, "text_config": {}},
        min_pixels=32 * 32,
        max_pixels=64 * 64,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
        processor=PROCESSOR,
        video_processor=VIDEO_PROCESSOR,
    )
