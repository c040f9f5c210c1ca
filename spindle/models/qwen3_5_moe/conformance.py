"""Qwen3.5-MoE's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

QWEN3_5_MOE = CausalLMConformanceSpec(
    # Spindle's MoE loss is stock's with output_router_logits: token loss + coef x router aux loss
    stock_loss_kwargs={"output_router_logits": True},
    stock_outputs=("aux_loss",),
    parallel=("dp_shard2", "sp2"),  # + ep2 (the experts part)
)
