"""patchgen config for transformers' Qwen3-MoE modeling -> generated/patched_modeling_qwen3_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3MoeForCausalLM.forward` calls the causal-LM forward the dense Qwen3 patch calls
(spindle/models/shared/causal_lm_patch.py); upstream's signature has `output_router_logits`, so that
forward also adds the router's load-balancing loss as upstream does (`router_aux_loss_coef x
load_balancing_loss_func`), through spindle.ops.router_loss: the same formula, whose router statistics
can be summed over a sequence-parallel group and masked for padding.

Everything else is upstream: the fused experts (`Qwen3MoeExperts`, stacked `gate_up_proj` /
`down_proj`) keep `@use_experts_implementation`, so `config._experts_implementation` picks
transformers' grouped_mm / batched_mm / eager kernels, and expert parallelism is installed on the
module by spindle.distributed.expert_parallel (transformers' EP styles on Spindle's mesh).
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_moe.modeling_qwen3_moe")
config.delegate_method(
    "Qwen3MoeForCausalLM.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
