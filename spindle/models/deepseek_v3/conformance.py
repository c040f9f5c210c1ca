"""DeepSeek-V3's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

DEEPSEEK_V3 = CausalLMConformanceSpec(
    # 1 dense layer then 2 MoE layers keep the suite fast while covering both MLP kinds. DeepSeek-V3 has no
    # router aux loss (its config has no router_aux_loss_coef): stock's loss is the token loss, Spindle's too.
    tiny_overrides={"num_hidden_layers": 3},
    # MLA projects one key/value per query head (DeepSeek-V3: num_key_value_heads == num_attention_heads)
    pair_overrides={"num_key_value_heads": 4},
)
