"""Causal attention with a sliding window and/or a learned sink logit per head, per packed document, in query
blocks: memory linear in the row length (no [S, S] mask, ever).

What it computes, for query i and key j of the same row (`documents`: the position-id rule of
spindle/ops/varlen_attention.py, a document starts wherever a position does not follow its predecessor):

    j attends  <=>  j <= i  and  i - j < window (when windowed)  and  document(j) == document(i)

which is transformers' `create_sliding_window_causal_mask` / `create_causal_mask` with packed documents
(`sliding_window_overlay`: kv_idx > q_idx - sliding_window). With `sinks` (GPT-OSS: one logit per head), each
query's softmax gets one more logit, the head's sink, whose probability is dropped: transformers' eager
`eager_attention_forward` of GPT-OSS, term for term (logits, sink column, max subtracted, softmax, sink dropped).

The queries run in blocks of `block` rows; a block's keys are the band that can reach it (window + block - 1
keys with a window, the prefix without), so each step holds a [block, band] mask and score matrix. Without
sinks a block is one `scaled_dot_product_attention` call with that boolean mask (transformers' sdpa path with
the dense mask, on a band); with sinks it is the eager computation above on the band.

Used by Spindle's Ulysses attention (spindle/distributed/ulysses_attention.py) over the full sequence of the
heads a rank holds; `sinks` is then that rank's slice of the heads' sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # query rows per step: a [BLOCK, window + BLOCK] score matrix per head at a time


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D]: query head h reads key/value head h // groups (transformers' repeat_kv)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    documents: torch.Tensor | None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    block: int = BLOCK,
) -> torch.Tensor:
    """[B, H, S, D] query, [B, Hkv, S, D] key/value -> [B, S, H, D]: causal attention within each document,
    over the last `window` keys when windowed, with one sink logit per head (`sinks`: [H]) when given.

    `documents`: [B, S] document index of each token (`varlen_attention.document_ids`), None for rows of one
    document. `dropout` applies to the attention probabilities (the caller passes 0.0 outside training)."""
    b, h, s, d = query.shape
    if h % key.shape[1]:
        raise ValueError(f"windowed_attention: {h} query heads are not a multiple of {key.shape[1]} key/value heads")
    if window is not None and window < 1:
        raise ValueError(f"windowed_attention: the sliding window must be >= 1 token, got {window}")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"windowed_attention: sinks must be one logit per query head ({h}), got {tuple(sinks.shape)}")
    key, value = _repeat_kv(key, h // key.shape[1]), _repeat_kv(value, h // value.shape[1])
    scale = d**-0.5 if scaling is None else scaling
    positions = torch.arange(s, device=query.device)
    out = []
    for q0 in range(0, s, block):
        q1 = min(q0 + block, s)
        k0 = 0 if window is None else max(0, q0 - window + 1)
        qi, kj = positions[q0:q1, None], positions[None, k0:q1]
        allowed = kj <= qi
        if window is not None:
            allowed = allowed & (qi - kj < window)
        mask = allowed[None, None]  # [1, 1, q, k]
        if documents is not None:
            mask = mask & (documents[:, None, q0:q1, None] == documents[:, None, None, k0:q1])
        q, k, v = query[:, :, q0:q1], key[:, :, k0:q1], value[:, :, k0:q1]
        if sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        else:
            logits = (q @ k.transpose(2, 3) * scale).masked_fill(~mask, float("-inf"))
            combined = torch.cat([logits, sinks.reshape(1, h, 1, 1).expand(b, h, q1 - q0, 1).to(logits.dtype)], -1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
            o = F.dropout(probs, p=dropout, training=dropout > 0).to(v.dtype) @ v
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()
