"""Qwen3-Omni-MoE's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

# what the MoE decoder adds
QWEN3_OMNI_MOE = CausalLMConformanceSpec(
    # Spindle's MoE loss is stock's with output_router_logits: token loss + coef x router aux loss
    stock_loss_kwargs={"output_router_logits": True},
    stock_outputs=("aux_loss",),
    # no dp_shard2: the ep2 layout the MoE task adds already FSDP2-shards the dense thinker over the same
    # 2 ranks, one of them audio-free
    parallel=("sp2",),
)
