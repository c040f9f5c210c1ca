"""patchgen config for transformers' Qwen3 modeling -> generated/patched_modeling_qwen3.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3.diff, run the
tests (docs/patchgen.md). Llama reuses these patches through name_map (../llama/patches.py).

Patched: `Qwen3ForCausalLM.forward` computes the loss from the last hidden states with the chunked
linear cross-entropy (spindle/ops/losses.py) instead of materialising [tokens, vocab] logits.
transformers has no hook for that: its loss_function receives logits.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from spindle.models.shared.causal_lm_patch import causal_lm_loss_or_logits
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3.modeling_qwen3")
config.add_import("spindle.ops.losses", names=["causal_lm_loss"])
config.add_helper(
    causal_lm_loss_or_logits,
    description="the chunked loss or upstream's logits (spindle/models/shared/causal_lm_patch.py)",
)


# Patch: Qwen3ForCausalLM.forward (upstream signature and decorators kept)
#   1. pop Spindle's loss kwargs (shift_labels, loss_reduction) so the decoder never sees them;
#   2. with labels or shift_labels: loss from hidden states via causal_lm_loss, logits=None;
#      without: exactly upstream (lm_head on the logits_to_keep slice): causal_lm_loss_or_logits.
@config.override_method(
    "Qwen3ForCausalLM.forward",
    description="loss from hidden states with the chunked linear cross-entropy (no full logits)",
)
def causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> CausalLMOutputWithPast:
    r"""
    Besides transformers' arguments, two keyword arguments select Spindle's loss (the loss is then
    computed chunk by chunk from the hidden states, and `logits` is None in the output):

    - `shift_labels`: labels already shifted (position t holds the token to predict at t), used
      instead of `labels` (packed rows whose documents must not predict across boundaries);
    - `loss_reduction="sum"`: return the plain sum over valid tokens (the caller normalises by a global
      token count); default: transformers' semantics (sum / num_items_in_batch, or the mean).
    """
    # --- Patch.1: Spindle's loss kwargs are for the loss only.
    shift_labels = kwargs.pop("shift_labels", None)
    loss_reduction = kwargs.pop("loss_reduction", None)
    outputs: BaseModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )

    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    # --- Patch.2: the chunked loss replaces lm_head + loss_function when there is something to learn.
    loss, logits = causal_lm_loss_or_logits(self, hidden_states, labels, shift_labels, loss_reduction, kwargs)

    return CausalLMOutputWithPast(
        loss=loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )
