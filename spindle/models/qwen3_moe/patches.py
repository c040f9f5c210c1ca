"""patchgen config for transformers' Qwen3-MoE modeling -> generated/patched_modeling_qwen3_moe.py.

Regenerate with `spindle patchgen` after editing, read generated/patched_modeling_qwen3_moe.diff, run
the tests (docs/patchgen.md).

Patched: `Qwen3MoeForCausalLM.forward` computes the token loss from the last hidden states with the
chunked linear cross-entropy (spindle/ops/losses.py), like the dense Qwen3 patch, and adds the
router's load-balancing loss as upstream does (`router_aux_loss_coef x load_balancing_loss_func` over
the forward's router logits), through spindle.ops.router_loss: the same formula, whose router
statistics can be summed over a sequence-parallel group and masked for padding. The dense patch cannot be reused
through `name_map`: upstream's MoE forward has `output_router_logits` and the aux term.

Everything else is upstream: the fused experts (`Qwen3MoeExperts`, stacked `gate_up_proj` /
`down_proj`) keep `@use_experts_implementation`, so `config._experts_implementation` picks
transformers' grouped_mm / batched_mm / eager kernels, and expert parallelism is installed on the
module by spindle.distributed.expert_parallel (transformers' EP styles on Spindle's mesh).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from spindle.models.shared.causal_lm_patch import add_moe_loss_helpers, causal_lm_loss_or_logits, with_router_aux_loss
from spindle.patchgen import PatchConfig

config = PatchConfig(source_module="transformers.models.qwen3_moe.modeling_qwen3_moe")
add_moe_loss_helpers(config)


# Patch: Qwen3MoeForCausalLM.forward (upstream signature and decorators kept)
#   1. pop Spindle's loss kwargs (shift_labels, loss_reduction, router_mask, router_group) so the
#      decoder never sees them;
#   2. with labels or shift_labels: token loss from hidden states via causal_lm_loss, logits=None;
#      without: exactly upstream (lm_head on the logits_to_keep slice): causal_lm_loss_or_logits;
#   3. the aux loss as upstream (spindle.ops.router_loss: the same formula, its router statistics
#      optionally reduced over an SP group), weighted so that it survives Spindle's sum reduction.
@config.override_method(
    "Qwen3MoeForCausalLM.forward",
    description="loss from hidden states with the chunked linear cross-entropy, plus upstream's router aux loss",
)
def moe_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> MoeCausalLMOutputWithPast:
    r"""
    Besides transformers' arguments, Spindle's loss arguments (as in the dense Qwen3 patch):
    `shift_labels` (already shifted labels, used instead of `labels`) and `loss_reduction="sum"`; and
    for the router aux loss: `router_mask` ([rows, seq], 1 = real token: the padding mask the aux loss
    uses instead of `attention_mask`, which is not passed to attention) and `router_group` (a process
    group whose ranks hold the other tokens of the same rows, sequence parallelism: the router
    statistics are summed over it, so the aux loss is the whole rows' one on every rank).

    The loss is upstream's `token loss + router_aux_loss_coef * aux_loss` whenever upstream computes
    it (mean token loss, `output_router_logits=True`). When the token loss is normalised by a count
    other than this batch's own valid tokens (`num_items_in_batch`, or `loss_reduction="sum"`: the
    caller divides by a global token count), the aux term is scaled by the batch's valid tokens over
    that count, so the accumulated loss over micro-batches and ranks is the mean token loss plus
    `router_aux_loss_coef` times the token-weighted mean of the micro-batches' aux losses; with one
    micro-batch that is exactly upstream's loss.
    """
    # --- Patch.1: Spindle's loss kwargs are for the loss only.
    shift_labels = kwargs.pop("shift_labels", None)
    loss_reduction = kwargs.pop("loss_reduction", None)
    router_mask = kwargs.pop("router_mask", None)
    router_group = kwargs.pop("router_group", None)
    output_router_logits = (
        output_router_logits if output_router_logits is not None else self.config.output_router_logits
    )
    outputs: MoeModelOutputWithPast = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_router_logits=output_router_logits,
        **kwargs,
    )

    hidden_states = outputs.last_hidden_state
    hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
    # --- Patch.2: the chunked loss replaces lm_head + loss_function when there is something to learn.
    loss, logits = causal_lm_loss_or_logits(self, hidden_states, labels, shift_labels, loss_reduction, kwargs)

    aux_loss = None
    if output_router_logits:
        # --- Patch.3: the aux term in the token loss's normalisation (1 for upstream's mean).
        mask = attention_mask if router_mask is None else router_mask
        loss, aux_loss = with_router_aux_loss(
            loss, outputs.router_logits, self.config, mask, router_group, labels, shift_labels, loss_reduction, kwargs
        )

    return MoeCausalLMOutputWithPast(
        loss=loss,
        aux_loss=aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        router_logits=outputs.router_logits,
    )
