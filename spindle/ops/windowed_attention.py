"""Causal attention with a sliding window and/or a learned sink logit per head, per packed document, in query
blocks: memory linear in the row length (no [S, S] mask, ever).

What it computes, for query i and key j of the same row (`documents`: the position-id rule of
spindle/ops/varlen_attention.py, a document starts wherever a position does not follow its predecessor):

    j attends  <=>  (j <= i  or  block(j) == block(i) >= 0)  and  i - j < window (when windowed)
                    and  document(j) == document(i)

which is transformers' `create_sliding_window_causal_mask` / `create_causal_mask` with packed documents
(`sliding_window_overlay`: kv_idx > q_idx - sliding_window). `blocks` (`block_ids`: transformers'
`block_sequence_ids`, -1 outside a block) are spans that attend both ways, an image's soft tokens in Gemma 3:
its `create_masks_for_vision_model`, causal OR same block on the global layers, that intersected with the window
on the sliding ones (the window bounds the past only, so a block's later tokens are always in reach). With `sinks` (GPT-OSS: one logit per head), each
query's softmax gets one more logit, the head's sink, whose probability is dropped: transformers' eager
`eager_attention_forward` of GPT-OSS, term for term (logits, sink column, max subtracted, softmax, sink dropped).

The queries run in blocks of `block` rows; a block's keys are the band that can reach it (window + block - 1
keys with a window, the prefix without; with blocks, up to the end of the last block a query of it is in), so
each step holds a [block, band] mask and score matrix. Without
sinks a block is one `scaled_dot_product_attention` call with that boolean mask (transformers' sdpa path with
the dense mask, on a band); with sinks it is the eager computation above on the band.

Used by Spindle's Ulysses attention (spindle/distributed/ulysses_attention.py) over the full sequence of the
heads a rank holds; `sinks` is then that rank's slice of the heads' sinks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128  # query rows per step: a [BLOCK, window + BLOCK] score matrix per head at a time


def block_ids(in_block: torch.Tensor) -> torch.Tensor | None:
    """[B, S] bool (True: a token of a bidirectional span, e.g. Gemma 3's `token_type_ids == 1`) -> [B, S] id of
    each token's span (a maximal run of True, numbered along the row from 0), -1 outside one: transformers'
    `get_block_sequence_ids_for_mask` (Gemma 3). None when no token is in a span."""
    if not bool(in_block.any()):
        return None
    starts = in_block & ~F.pad(in_block, (1, 0), value=False)[:, :-1]
    return torch.where(in_block, starts.long().cumsum(-1) - 1, -1)


def _reach(blocks: torch.Tensor) -> list[int]:
    """[S]: the last key index any row's query i may attend (i itself, or the end of i's block)."""
    s = blocks.shape[1]
    index = torch.arange(s, device=blocks.device).expand_as(blocks)
    ends = (blocks >= 0) & (blocks != F.pad(blocks, (0, 1), value=-1)[:, 1:])  # a block's last token
    last = torch.where(ends, index, s).flip(-1).cummin(-1).values.flip(-1)  # the next block end at or after i
    return torch.where(blocks >= 0, last, index).amax(0).tolist()


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
    blocks: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    block: int = BLOCK,
) -> torch.Tensor:
    """[B, H, S, D] query, [B, Hkv, S, D] key/value -> [B, S, H, D]: causal attention within each document,
    over the last `window` keys when windowed, with one sink logit per head (`sinks`: [H]) when given.

    `documents`: [B, S] document index of each token (`varlen_attention.document_ids`), None for rows of one
    document. `blocks`: [B, S] bidirectional span of each token (`block_ids`), None for none. `dropout` applies to the attention probabilities (the caller passes 0.0 outside training)."""
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
    reach = None if blocks is None else _reach(blocks)
    out = []
    for q0 in range(0, s, block):
        q1 = min(q0 + block, s)
        k0 = 0 if window is None else max(0, q0 - window + 1)
        k1 = q1 if reach is None else max(q1, max(reach[q0:q1]) + 1)
        qi, kj = positions[q0:q1, None], positions[None, k0:k1]
        mask = (kj <= qi)[None, None]  # [1, 1, q, k]
        if blocks is not None:
            bq, bk = blocks[:, None, q0:q1, None], blocks[:, None, None, k0:k1]
            mask = mask | ((bq == bk) & (bq >= 0))
        if window is not None:
            mask = mask & (qi - kj < window)
        if documents is not None:
            mask = mask & (documents[:, None, q0:q1, None] == documents[:, None, None, k0:k1])
        q, k, v = query[:, :, q0:q1], key[:, :, k0:k1], value[:, :, k0:k1]
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
