"""patchgen config for transformers' Qwen3.5-MoE modeling -> generated/patched_modeling_qwen3_5_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_5_moe.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen3_5MoeForConditionalGeneration.forward` calls the causal-LM forward of the MoE patches
(spindle/models/shared/causal_lm_patch.py): the token loss from the last hidden states with the chunked linear
cross-entropy, and the router's load-balancing loss as upstream adds it, masked for padding and weighted to
survive Spindle's summed loss (spindle/models/qwen3_vl_moe/patches.py says why). Everything else is upstream:
the vision tower, the 3-D RoPE, the Gated DeltaNet and attention layers, the fused experts and shared expert.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
config.delegate_method(
    "Qwen3_5MoeForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
