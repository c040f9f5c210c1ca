"""Patch fragments shared by the causal-LM patch configs (qwen3/patches.py, hence llama's, and qwen3_moe's).

The dense and the MoE `ForCausalLM.forward` patches differ in what upstream's forwards differ in (the
MoE one takes `output_router_logits` and adds the router aux loss); the Spindle part they share, the
token loss from hidden states instead of logits, is written once here. Each config registers it with
`config.add_helper(...)`, so patchgen copies it into every generated module: generated code stays
self-contained and reviewable, and never imports this file.
"""

from __future__ import annotations

from spindle.ops.losses import causal_lm_loss


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
