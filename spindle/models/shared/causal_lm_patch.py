"""The patched forward of every causal-LM head Spindle trains (Qwen3, Llama, Qwen3-MoE, and the
Qwen3-VL-MoE / Qwen3-Omni-MoE thinkers' ForConditionalGeneration): `causal_lm_forward`.

transformers has no hook for it: its loss_function receives logits (Spindle computes the loss from the
hidden states, chunk by chunk, never materialising [tokens, vocab] logits), and a MoE forward adds the
router's load-balancing loss inline (Spindle masks it for padding, sums its statistics over a
sequence-parallel group, and weighs it so that it survives a summed token loss). Each family's
`patches.py` points patchgen at this function (`config.delegate_method(..., to=causal_lm_forward)`):
the generated method keeps upstream's signature, decorators and docstring, and its body is one call
passing every parameter on by name, so the logic lives here once and the generated module imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from spindle.ops.losses import causal_lm_loss
from spindle.ops.router_loss import load_balancing_loss

# What the forwards pass on from the decoder's output unchanged (a MoE one also its router logits).
PASSED_ON = ("past_key_values", "hidden_states", "attentions")


def causal_lm_forward(model, *, labels=None, logits_to_keep=0, **inputs: Any):
    """Upstream's `ForCausalLM.forward` (or a VLM's `ForConditionalGeneration.forward`), with Spindle's loss.

    `model` is the head (it has `.model`, `.lm_head`, `.config`); `inputs` are the other upstream
    parameters, passed on to `model.model` as upstream does, after Spindle's own are taken out:

    - `shift_labels`: labels already shifted (position t holds the token to predict at t), used instead
      of `labels` (packed rows whose documents must not predict across boundaries);
    - `loss_reduction="none"`: each token's loss [rows, seq] (sequence objectives: DPO, GRPO), a MoE's aux loss
      returned apart, not added;
    - `loss_reduction="sum"`: the plain sum over valid tokens (the caller normalises by a global token
      count); default: transformers' semantics (sum / `num_items_in_batch`, or the mean).

    With `labels` or `shift_labels` the loss is the chunked linear cross-entropy from the hidden states
    and `logits` is None; without, the logits are exactly upstream's (`lm_head` on the `logits_to_keep`
    slice), so `generate()` is unchanged.

    A MoE forward (upstream's signature has `output_router_logits`, so it is in `inputs`) returns
    `MoeCausalLMOutputWithPast` with upstream's router aux loss (`with_router_aux_loss`), and takes two
    more: `router_mask` ([rows, seq], 1 = real token: the padding mask the aux loss uses instead of
    `attention_mask`, which is not passed to attention) and `router_group` (the process group holding
    the other tokens of the same rows: sequence parallelism).
    """
    shift_labels = inputs.pop("shift_labels", None)
    loss_reduction = inputs.pop("loss_reduction", None)
    moe = "output_router_logits" in inputs
    if moe:
        router_mask = inputs.pop("router_mask", None)
        router_group = inputs.pop("router_group", None)
        moe_config = model.config.get_text_config()  # the MoE decoder's config (a VLM's text_config)
        if inputs["output_router_logits"] is None:
            inputs["output_router_logits"] = moe_config.output_router_logits
    outputs = model.model(**inputs)
    hidden_states = slice_logits_to_keep(outputs[0], logits_to_keep)
    loss, logits = causal_lm_loss_or_logits(model, hidden_states, labels, shift_labels, loss_reduction, inputs)
    passed_on = {name: getattr(outputs, name) for name in PASSED_ON}
    if not moe:
        return CausalLMOutputWithPast(loss=loss, logits=logits, **passed_on)
    aux_loss = None
    if inputs["output_router_logits"]:
        mask = inputs.get("attention_mask") if router_mask is None else router_mask
        loss, aux_loss = with_router_aux_loss(
            loss, outputs.router_logits, moe_config, mask, router_group, labels, shift_labels, loss_reduction, inputs
        )
    return MoeCausalLMOutputWithPast(
        loss=loss, aux_loss=aux_loss, logits=logits, router_logits=outputs.router_logits, **passed_on
    )


def causal_lm_loss_or_logits(model, hidden_states, labels, shift_labels, loss_reduction, kwargs) -> tuple:
    """(loss, logits) of a causal-LM head on `hidden_states` (already sliced to `logits_to_keep`).

    Without `labels` or `shift_labels`: (None, upstream's logits), so `generate()` is unchanged.
    Otherwise: (the chunked linear cross-entropy from the hidden states, None); the [tokens, vocab]
    logits are never materialised. `kwargs` are the forward's transformers kwargs (read, not changed).
    A head whose config sets `final_logit_softcapping` (Gemma's) soft-caps the logits on both paths, as
    upstream's forward does.
    """
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if labels is None and shift_labels is None:
        logits = model.lm_head(hidden_states)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return None, logits
    loss = causal_lm_loss(
        hidden_states,
        model.lm_head.weight,
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        loss_reduction=loss_reduction,
        ignore_index=kwargs.get("ignore_index", -100),
        softcap=softcap,
    )
    return loss, None


def count_label_tokens(labels, shift_labels, ignore_index: int = -100) -> torch.Tensor:
    """The tokens a causal-LM loss averages over: valid shifted labels (as `causal_lm_loss` shifts them)."""
    if shift_labels is None:
        shift_labels = labels[..., 1:]
    return (shift_labels != ignore_index).sum().to(torch.float32)


def with_router_aux_loss(loss, router_logits, moe_config, mask, group, labels, shift_labels, loss_reduction, kwargs):
    """(loss with the router's load-balancing term, the aux loss) of a MoE forward.

    The aux loss is upstream's `load_balancing_loss_func` (spindle.ops.router_loss: the same formula, its
    router statistics masked by `mask` and summed over `group`, a sequence-parallel group). The loss is
    upstream's `token loss + router_aux_loss_coef * aux_loss` whenever upstream computes it (mean token
    loss). When the token loss is normalised by a count other than this batch's own valid tokens
    (`num_items_in_batch`, or `loss_reduction="sum"`: the caller divides by a global token count), the aux
    term is scaled by the batch's valid tokens over that count, so the accumulated loss over micro-batches
    and ranks is the mean token loss plus `router_aux_loss_coef` times the token-weighted mean of the
    micro-batches' aux losses; with one micro-batch that is exactly upstream's loss. `loss` None (no
    labels): (None, the aux loss).
    """
    aux_loss = load_balancing_loss(
        router_logits, moe_config.num_experts, moe_config.num_experts_per_tok, mask, group=group
    )
    if loss is None or loss_reduction == "none":  # no token loss, or per-token losses: the aux loss apart
        return loss, aux_loss
    num_items_in_batch = kwargs.get("num_items_in_batch")
    weight: torch.Tensor | float
    if loss_reduction == "sum" or (loss_reduction is None and num_items_in_batch is not None):
        tokens = count_label_tokens(labels, shift_labels, kwargs.get("ignore_index", -100))
        divisor = 1 if loss_reduction == "sum" else num_items_in_batch
        weight = tokens / torch.as_tensor(divisor, dtype=torch.float32, device=loss.device)
    else:
        weight = 1.0
    return loss + moe_config.router_aux_loss_coef * aux_loss.to(loss.device) * weight, aux_loss
