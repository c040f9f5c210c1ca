"""patchgen config for transformers' Qwen3.5 modeling -> generated/patched_modeling_qwen3_5.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_5.diff, run the
tests (docs/patchgen.md).

Patched: `Qwen3_5ForConditionalGeneration.forward` calls the causal-LM forward every patched family shares
(spindle/models/shared/causal_lm_patch.py): with labels, the token loss from the last hidden states with the
chunked linear cross-entropy, never the [tokens, vocab] logits (248K columns a token); without, the logits
exactly as upstream computes them. Everything else is upstream: the vision tower, the 3-D RoPE, the Gated
DeltaNet and full-attention layers.
"""

from spindle.models.shared.patched_conversions import chunked_loss_head_patch

config = chunked_loss_head_patch("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5ForConditionalGeneration")
