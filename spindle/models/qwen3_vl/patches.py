"""patchgen config for transformers' Qwen3-VL modeling -> generated/patched_modeling_qwen3_vl.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_vl.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen3VLForConditionalGeneration.forward` calls the causal-LM forward every patched family shares
(spindle/models/shared/causal_lm_patch.py): with labels, the token loss from the last hidden states with
the chunked linear cross-entropy, never the [tokens, vocab] logits (152K columns a token); without, the
logits exactly as upstream computes them, so `generate()` is unchanged.

At import the generated module keeps transformers' checkpoint key conversions for its classes
(spindle/models/shared/patched_conversions.py: transformers skips them for classes outside its package),
so Hub checkpoints load and exports are saved under stock names. Everything else is upstream: the
towers, the 3-D RoPE and the language model.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_vl.modeling_qwen3_vl")
config.delegate_method(
    "Qwen3VLForConditionalGeneration.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy",
)
config.add_import("spindle.models.shared.patched_conversions", names=["keep_conversions"])
config.add_post_import_block(
    'keep_conversions("transformers.models.qwen3_vl.modeling_qwen3_vl")',
    description="transformers' checkpoint key conversions apply to the generated classes too",
)
