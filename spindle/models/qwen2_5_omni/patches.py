"""patchgen config for transformers' Qwen2.5-Omni modeling -> generated/patched_modeling_qwen2_5_omni.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen2_5_omni.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen2_5OmniThinkerForConditionalGeneration.forward` calls the causal-LM forward every patched family shares
(spindle/models/shared/causal_lm_patch.py): with labels, the token loss from the last hidden states with
the chunked linear cross-entropy, never the [tokens, vocab] logits (152K columns a token); without, the
logits exactly as upstream computes them, so `generate()` is unchanged.

At import the generated module keeps transformers' checkpoint key conversions for its classes
(spindle/models/shared/patched_conversions.py: transformers skips them for classes outside its package),
so Hub checkpoints load and exports are saved under stock names. Everything else is upstream: the
towers, the 3-D RoPE and the language model.
"""

from spindle.models.shared.patched_conversions import chunked_loss_head_patch

config = chunked_loss_head_patch(
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni", "Qwen2_5OmniThinkerForConditionalGeneration"
)
