"""Patch fragments shared by the causal-LM patch configs (qwen3/patches.py, hence llama's, qwen3_moe's and
qwen3_vl_moe's).

The dense and the MoE `ForCausalLM.forward` patches differ in what upstream's forwards differ in (the
MoE one takes `output_router_logits` and adds the router aux loss); the Spindle part they share, the
token loss from hidden states instead of logits (and the MoE forwards' router aux term), is written once
here. Each config registers what it uses with `config.add_helper(...)`, so patchgen copies it into every
generated module: generated code stays self-contained and reviewable, and never imports this file.
"""

from __future__ import annotations

import torch

from spindle.ops.losses import causal_lm_loss
from spindle.ops.router_loss import load_balancing_loss


def causal_lm_loss_or_logits(model, hidden_states, labels, shift_labels, loss_reduction, kwargs) -> tuple:
    """(loss, logits) of a causal-LM head on `hidden_states` (already sliced to `logits_to_keep`).

    Without `labels` or `shift_labels`: (None, upstream's logits), so `generate()` is unchanged.
    Otherwise: (the chunked linear cross-entropy from the hidden states, None); the [tokens, vocab]
    logits are never materialised. `kwargs` are the forward's transformers kwargs (read, not changed).
    """
    if labels is None and shift_labels is None:
        return None, model.lm_head(hidden_states)
    loss = causal_lm_loss(
        hidden_states,
        model.lm_head.weight,
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=kwargs.get("num_items_in_batch"),
        loss_reduction=loss_reduction,
        ignore_index=kwargs.get("ignore_index", -100),
    )
    return loss, None


def count_label_tokens(labels, shift_labels, ignore_index: int = -100) -> torch.Tensor:
    """The tokens a causal-LM loss averages over: valid shifted labels (as `causal_lm_loss` shifts them)."""
    if shift_labels is None:
        shift_labels = labels[..., 1:]
    return (shift_labels != ignore_index).sum().to(torch.float32)


def with_router_aux_loss(loss, router_logits, moe_config, mask, group, labels, shift_labels, loss_reduction, kwargs):
    """(loss with the router's load-balancing term, the aux loss) of a MoE forward (the MoE patches).

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
    if loss is None:
        return None, aux_loss
    num_items_in_batch = kwargs.get("num_items_in_batch")
    weight: torch.Tensor | float
    if loss_reduction == "sum" or (loss_reduction is None and num_items_in_batch is not None):
        tokens = count_label_tokens(labels, shift_labels, kwargs.get("ignore_index", -100))
        divisor = 1 if loss_reduction == "sum" else num_items_in_batch
        weight = tokens / torch.as_tensor(divisor, dtype=torch.float32, device=loss.device)
    else:
        weight = 1.0
    return loss + moe_config.router_aux_loss_coef * aux_loss.to(loss.device) * weight, aux_loss


def add_moe_loss_helpers(config) -> None:
    """Register on a MoE patch config (a patchgen `PatchConfig`) the imports and helpers its forward uses:
    the chunked loss (`causal_lm_loss_or_logits`) and the router aux term (`with_router_aux_loss`)."""
    config.add_import("spindle.ops.losses", names=["causal_lm_loss"])
    config.add_import("spindle.ops.router_loss", names=["load_balancing_loss"])
    here = "spindle/models/shared/causal_lm_patch.py"
    config.add_helper(causal_lm_loss_or_logits, description=f"the chunked loss or upstream's logits ({here})")
    config.add_helper(count_label_tokens, description=f"the valid label tokens of a batch ({here})")
    config.add_helper(
        with_router_aux_loss, description=f"upstream's router aux loss, in Spindle's normalisation ({here})"
    )
