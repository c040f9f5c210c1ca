"""patchgen config for transformers' DeepSeek-V3 modeling -> generated/patched_modeling_deepseek_v3.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_deepseek_v3.diff, run
the tests (docs/patchgen.md).

Patched: `DeepseekV3ForCausalLM.forward` calls the causal-LM forward every family's patch calls
(spindle/models/shared/causal_lm_patch.py): the loss from the hidden states with the chunked linear
cross-entropy. Upstream's signature has no `output_router_logits` (DeepSeek-V3 has no router aux loss), so
that forward adds none, as upstream adds none.

Everything else is upstream: multi-head latent attention, the group-limited sigmoid router
(`DeepseekV3TopkRouter`), the shared experts, and the fused routed experts (`DeepseekV3Experts`) keeping
`@use_experts_implementation`, so `config._experts_implementation` picks transformers' grouped_mm /
batched_mm / eager kernels, and expert parallelism is installed on the module by
spindle.distributed.expert_parallel.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.deepseek_v3.modeling_deepseek_v3")
config.delegate_method(
    "DeepseekV3ForCausalLM.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy",
)
