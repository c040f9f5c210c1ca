"""gpt-oss's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

GPT_OSS = CausalLMConformanceSpec(
    # 2 layers (one sliding, one full) keep the suite fast; an aux coefficient of 0.1 makes a wrong aux loss
    # show in the step loss
    tiny_overrides={"num_hidden_layers": 2, "router_aux_loss_coef": 0.1},
    # Spindle's MoE loss is stock's with output_router_logits: token loss + coef x router aux loss
    stock_loss_kwargs={"output_router_logits": True},
    stock_outputs=("aux_loss",),
)
