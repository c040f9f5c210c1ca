"""patchgen config for transformers' Qwen3-VL-MoE modeling -> generated/patched_modeling_qwen3_vl_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_vl_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3VLMoeForConditionalGeneration.forward` calls the causal-LM forward of the Qwen3-MoE patch
(spindle/models/shared/causal_lm_patch.py): the token loss from the last hidden states with the chunked
linear cross-entropy, and the router's load-balancing loss as upstream adds it, masked for padding
(`router_mask`), summed over a sequence-parallel group (`router_group`) and weighted to survive
Spindle's summed loss. Upstream adds `router_aux_loss_coef x aux_loss` to a loss its caller may have
asked to be a sum: without the patch the aux term would be divided by the global token count.

Everything else is upstream: the vision tower, the 3-D RoPE, deepstack, and the fused experts
(`Qwen3VLMoeTextExperts`, with `@use_experts_implementation`); expert parallelism is installed on the
experts by spindle.distributed.expert_parallel.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")
config.delegate_method(
    "Qwen3VLMoeForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
