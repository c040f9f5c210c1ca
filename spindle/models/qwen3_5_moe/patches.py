"""patchgen config for transformers' Qwen3.5-MoE modeling -> generated/patched_modeling_qwen3_5_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_5_moe.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen3_5MoeForConditionalGeneration.forward` calls the causal-LM forward of the MoE patches
(spindle/models/shared/causal_lm_patch.py): the token loss from the last hidden states with the chunked linear
cross-entropy, and the router's load-balancing loss as upstream adds it, masked for padding and weighted to
survive Spindle's summed loss (spindle/models/qwen3_vl_moe/patches.py says why). Everything else is upstream:
the vision tower, the 3-D RoPE, the attention layers, the fused experts and shared expert. The Gated DeltaNet
layer's forward gets Qwen3.5's override (spindle/models/qwen3_5/patches.py): under Ulysses SP, its convolution
and recurrence over the whole sequence of the rank's heads.
"""

from spindle.models.qwen3_5 import patches as qwen3_5
from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
config.delegate_method(
    "Qwen3_5MoeForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
config.add_import("spindle.distributed.ulysses_attention", names=["sequence_parallel_context"])
config.add_import("spindle.distributed.ulysses_linear_attention", names=["gated_deltanet_forward"])
config.override_method(
    "Qwen3_5MoeGatedDeltaNet.forward",
    replacement=qwen3_5.forward,
    description="under Ulysses SP: convolution and recurrence over the whole sequence of this rank's heads",
)
config.override_method(
    "Qwen3_5MoeModel.__init__",
    replacement=qwen3_5.__init__,
    name_map={"Qwen3_5": "Qwen3_5Moe"},
    description="the language model is this module's Qwen3_5MoeTextModel (its Gated DeltaNet layers patched)",
)
