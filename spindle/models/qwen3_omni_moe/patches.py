"""patchgen config for transformers' Qwen3-Omni-MoE modeling -> generated/patched_modeling_qwen3_omni_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_omni_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3OmniMoeThinkerForConditionalGeneration.forward` calls the causal-LM forward the Qwen3-VL-MoE
patch calls (spindle/models/shared/causal_lm_patch.py): the token loss from the last hidden states with
the chunked linear cross-entropy, and the router's load-balancing loss as upstream adds it (masked for
padding with `router_mask`, summed over a sequence-parallel `router_group`, weighted to survive
Spindle's summed loss). The thinker has no `logits_to_keep`: its logits cover every position, as upstream.

Everything else is upstream: the audio encoder, the vision tower, the 3-D RoPE, deepstack, the fused
experts (`@use_experts_implementation`), the talker and code2wav (never trained, never loaded by Spindle);
expert parallelism is installed on the experts by spindle.distributed.expert_parallel.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
config.delegate_method(
    "Qwen3OmniMoeThinkerForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
