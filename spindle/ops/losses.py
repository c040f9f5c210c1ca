"""Chunked linear cross-entropy: the causal-LM loss computed from hidden states, never from full logits.

`lm_head(hidden)` for a whole packed batch is a [tokens, vocab] tensor (e.g. 32k tokens x 152k vocab in
fp32 = 19 GB) that only exists to be reduced to one number. `linear_cross_entropy` instead walks the
tokens in chunks: each chunk's logits are computed, upcast to fp32, reduced to the chunk's loss, and
turned straight into that chunk's gradients for the hidden states and the weight (the fused-linear-CE
trick of Liger and friends), so forward and backward together hold at most one chunk's logits.

`linear_log_probs` is the same walk for per-token log-probabilities (the preference and RL objectives'
input, `spindle.train.objectives`): forward keeps no logits, backward recomputes each chunk's.

`softcap` (a head's `final_logit_softcapping`, Gemma's): the logits are `softcap * tanh(logits / softcap)`
before the softmax, as the model's own head computes them; the gradients go through the tanh.

Pure torch on purpose: the patched transformers forwards (`spindle/models/*/generated/`) and the
trainer call it without importing transformers here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

REDUCTIONS = ("sum", "mean")


def _chunk_scores(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    ignore_index: int,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's fp32 logits (soft-capped by `softcap`, then divided by `temperature`), their log-sum-exp, the
    label's logit, which labels are valid, and the labels with the ignored ones replaced by 0 (safe to index with)."""
    # Logits in the input dtype (as nn.Linear computes them), then fp32 for the softmax.
    logits = F.linear(h, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if temperature != 1.0:
        logits = logits / temperature
    valid = y != ignore_index
    safe_y = torch.where(valid, y, torch.zeros_like(y))
    lse = torch.logsumexp(logits, dim=-1)
    target_logit = logits.gather(1, safe_y.unsqueeze(1)).squeeze(1)
    return logits, lse, target_logit, valid, safe_y


def _softcap_slope(logits: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor | None:
    """d(capped logit)/d(raw logit) = 1 - tanh^2 at each of a chunk's logits (as `_chunk_scores` returns them:
    capped, then divided by `temperature`); None without a cap. Taken before the caller reuses `logits`."""
    if softcap is None:
        return None
    return 1 - (logits * (temperature / softcap)).square()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of token cross-entropies of `hidden @ weight.T (+ bias)`; gradients are computed in forward.

    Computing each chunk's gradient while its logits are live is what keeps the backward from holding
    (or recomputing) every chunk's logits; backward only scales the stored gradients by the incoming
    scalar gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
        scale: float,
        need_grads: tuple[bool, bool, bool],
        softcap: float | None,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grads[0] else None
        # fp32 accumulators: summing many chunks' low-precision partial products loses too much.
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_grads[1] else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
            if bias is not None and need_grads[2]
            else None
        )
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            h = hidden[start:end]
            logits, lse, target_logit, valid, safe_y = _chunk_scores(
                h, weight, bias, labels[start:end], ignore_index, softcap=softcap
            )
            total += torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
            if grad_hidden is None and grad_weight is None and grad_bias is None:
                continue
            slope = _softcap_slope(logits, 1.0, softcap)
            # d(loss)/d(logits) = softmax - onehot(label), zero on ignored tokens, times the reduction scale.
            grad_logits = logits.sub_(lse.unsqueeze(1)).exp_()
            grad_logits.scatter_add_(1, safe_y.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
            grad_logits.mul_((valid.to(grad_logits.dtype) * scale).unsqueeze(1))
            if slope is not None:
                grad_logits.mul_(slope)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del logits, grad_logits
        ctx.save_for_backward(
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None,
        )
        return total * scale

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        grads = [None if g is None else g * grad_output.to(g.dtype) for g in (grad_hidden, grad_weight, grad_bias)]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None


def check_linear_inputs(
    name: str, hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> None:
    """The chunked head functions' shared argument checks (`name` in the messages)."""
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if hidden_states.shape[:-1] != labels.shape:
        raise ValueError(
            f"{name}: labels shape {tuple(labels.shape)} does not match hidden_states "
            f"{tuple(hidden_states.shape)} without its last (hidden) dim; pass labels already shifted, one per position"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"{name}: weight must be [vocab, hidden={hidden_states.shape[-1]}], got {tuple(weight.shape)}")


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    reduction: str = "sum",
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden_states @ weight.T (+ bias)` (soft-capped by `softcap`) against `labels`,
    `chunk_size` tokens at a time.

    hidden_states: [..., H]; weight: [V, H] (the lm_head weight); labels: [...], already shifted (the label
    at position t is the token to predict at t), `ignore_index` entries contribute nothing.
    reduction: "sum" over valid tokens, or "mean" over valid tokens (0 valid tokens -> loss 0 with zero
    gradients, not NaN). Equals `F.cross_entropy(hidden @ weight.T, labels, reduction=...)` with the
    logits upcast to fp32, without ever holding more than `chunk_size` x V logits.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r} is not one of {REDUCTIONS}")
    check_linear_inputs("linear_cross_entropy", hidden_states, weight, labels, chunk_size)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).to(hidden.device)
    if reduction == "mean":
        # A host sync per call; the mean needs the count before the per-chunk gradients are scaled.
        num_valid = int((flat_labels != ignore_index).sum())
        scale = 1.0 / num_valid if num_valid > 0 else 0.0
    else:
        scale = 1.0
    grad_on = torch.is_grad_enabled()
    need_grads = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    # torch's Function.apply is unannotated
    loss: torch.Tensor = _ChunkedLinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, flat_labels, ignore_index, chunk_size, scale, need_grads, softcap
    )
    return loss


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: torch.Tensor | int | None = None,
    loss_reduction: str | None = None,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The loss transformers' `ForCausalLMLoss` computes from logits, computed from hidden states instead.
    `softcap`: the head's final logit soft-capping (None: none).

    `labels` are unshifted (stock semantics: position t predicts labels[t + 1]); `shift_labels`, when
    given, are already shifted and win over `labels` (what Spindle's trainer passes for packed rows).
    loss_reduction None: sum / num_items_in_batch when that is given, else the mean over valid tokens
    (transformers' semantics); "sum": the plain sum over valid tokens (the caller normalises by a global
    count); "mean": the mean over valid tokens; "none": each token's loss, shaped like the shifted labels (0
    where ignored; the negated `linear_log_probs`).
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: pass labels (unshifted) or shift_labels (already shifted)")
        # Shift so that tokens < n predict n; the last position has nothing to predict.
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if loss_reduction == "none":  # per-token losses (sequence objectives weigh each row's tokens themselves)
        return -linear_log_probs(
            hidden_states,
            weight,
            shift_labels,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
            bias=bias,
            softcap=softcap,
        )
    if loss_reduction not in (None, *REDUCTIONS):
        raise ValueError(f"loss_reduction={loss_reduction!r} is not one of None, 'none', 'sum', 'mean'")
    if loss_reduction is None:
        reduction = "sum" if num_items_in_batch is not None else "mean"
    else:
        reduction = loss_reduction
    loss = linear_cross_entropy(
        hidden_states,
        weight,
        shift_labels,
        ignore_index=ignore_index,
        chunk_size=chunk_size,
        reduction=reduction,
        bias=bias,
        softcap=softcap,
    )
    if loss_reduction is None and num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


class _ChunkedLinearLogProbs(torch.autograd.Function):
    """Per-token log-probabilities of the labels under `hidden @ weight.T (+ bias)` / temperature, chunk by chunk.

    The output is one value per token, so (unlike the summed cross-entropy) its gradient is not known in
    forward: backward recomputes each chunk's logits instead of keeping them (one chunk's logits live at a time).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
        temperature: float,
        softcap: float | None,
    ) -> torch.Tensor:
        out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            _, lse, target, valid, _ = _chunk_scores(
                hidden[start:end], weight, bias, labels[start:end], ignore_index, temperature, softcap
            )
            out[start:end] = torch.where(valid, target - lse, torch.zeros_like(lse))
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.settings = (ignore_index, chunk_size, temperature, softcap)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, labels = ctx.saved_tensors
        ignore_index, chunk_size, temperature, softcap = ctx.settings
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if bias is not None and need_bias else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logits, lse, _, valid, safe_y = _chunk_scores(
                h, weight, bias, labels[start:end], ignore_index, temperature, softcap
            )
            slope = _softcap_slope(logits, temperature, softcap)
            # d(log p_y)/d(logits) = onehot(y) - softmax, times the incoming gradient, zero on ignored tokens;
            # the logits were divided by the temperature, so their pre-division gradient is too.
            g = torch.where(valid, grad_output[start:end].float(), torch.zeros_like(lse)) / temperature
            grad_logits = logits.sub_(lse.unsqueeze(1)).exp_().mul_(-g.unsqueeze(1))
            grad_logits.scatter_add_(1, safe_y.unsqueeze(1), g.unsqueeze(1))
            if slope is not None:
                grad_logits.mul_(slope)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
            del logits, grad_logits
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 1024,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """log softmax(`hidden_states @ weight.T (+ bias)`, soft-capped by `softcap`, / temperature) at each label,
    `chunk_size` tokens at a time.

    hidden_states: [..., H]; weight: [V, H]; labels: [...], already shifted (the token position t predicts);
    -> fp32 [...], 0 where the label is `ignore_index`. Equals `log_softmax(logits.float() / T).gather(labels)`
    (TRL's `selective_log_softmax` on the model's logits) without holding more than `chunk_size` x V logits,
    forward or backward. `temperature` is the sampling temperature (GRPO scores completions as sampled).
    """
    if temperature <= 0:
        raise ValueError(f"linear_log_probs: temperature must be > 0, got {temperature}")
    check_linear_inputs("linear_log_probs", hidden_states, weight, labels, chunk_size)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    flat_labels = labels.reshape(-1).to(hidden.device)
    # torch's Function.apply is unannotated
    out: torch.Tensor = _ChunkedLinearLogProbs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, bias, flat_labels, ignore_index, chunk_size, temperature, softcap
    )
    return out.view(labels.shape)
