"""Ring-attention numerics: one KV block's attention with its log-sum-exp, its flash-style backward
given the global (out, lse), and the online-softmax merge of partial results. Device-agnostic fp32 math;
the communication around them (which rank holds which KV chunk) is `spindle.distributed.context_parallel`'s."""

from __future__ import annotations

import torch


def attention_scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention logits [B, H, Sq, Skv] of fp32 [B, H, S, D] inputs; a bool mask keeps True keys, a float
    mask is added (SDPA's conventions)."""
    s = q @ k.transpose(-1, -2) * scale
    if mask is None:
        return s
    return s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp to subtract: 0 where it is -inf (every key masked), so exp(-inf - 0) = 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def block_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV block in fp32: [B, S, H, D] in -> (out [B, S, H, D], lse [B, S, H]); a query whose keys in
    this block are all masked gets out 0 and lse -inf (it then contributes nothing to the merge)."""
    q, k, v = (x.transpose(1, 2).float() for x in (query, key, value))
    s = attention_scores(q, k, mask, scale)
    lse = torch.logsumexp(s, -1, keepdim=True)
    out = torch.exp(s - finite_lse(lse)) @ v
    return out.transpose(1, 2), lse.squeeze(-1).transpose(1, 2)


def block_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 gradients (q, k, v) of one KV block given the global (out, lse) over all blocks: the
    flash-attention backward, P = exp(S - lse), dS = P * (dP - rowsum(dO * O)). Masked keys have P = 0."""
    q, k, v, o, do = (x.transpose(1, 2).float() for x in (query, key, value, out, grad_out))
    p = torch.exp(attention_scores(q, k, mask, scale) - finite_lse(lse.float().transpose(1, 2).unsqueeze(-1)))
    grad_v = p.transpose(-1, -2) @ do
    grad_s = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    grad_q = grad_s @ k * scale
    grad_k = grad_s.transpose(-1, -2) @ q * scale
    return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)


def merge_blocks(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial results; safe when either (or both) lse is -inf."""
    new = torch.logaddexp(lse, block_lse)
    ref = finite_lse(new)
    out = out * torch.exp(lse - ref).unsqueeze(-1) + block_out * torch.exp(block_lse - ref).unsqueeze(-1)
    return out, new
