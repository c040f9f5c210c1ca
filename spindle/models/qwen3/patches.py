"""patchgen config for transformers' Qwen3 modeling -> generated/patched_modeling_qwen3.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3.diff, run the
tests (docs/patchgen.md). Llama reuses this config through name_map (../llama/patches.py).

Patched: `Qwen3ForCausalLM.forward` keeps upstream's signature, decorators and docstring and calls
Spindle's causal-LM forward (spindle/models/shared/causal_lm_patch.py), which computes the loss from the
last hidden states with the chunked linear cross-entropy (spindle/ops/losses.py) instead of
materialising [tokens, vocab] logits. transformers has no hook for that: its loss_function receives logits.
"""

from spindle.models.shared.causal_lm_patch import causal_lm_forward
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3.modeling_qwen3")
config.delegate_method(
    "Qwen3ForCausalLM.forward",
    to=causal_lm_forward,
    description="loss from hidden states with the chunked linear cross-entropy (no full logits)",
)
