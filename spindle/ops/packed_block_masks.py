"""The attention masks of packed rows whose documents hold bidirectional blocks (Gemma 3's image soft tokens), in
the form a transformers decoder takes them: `{"full_attention": mask, "sliding_attention": mask}`, built with
transformers' own mask interface for the model's attention implementation.

Why Spindle builds them: transformers' `create_masks_for_vision_model` (Gemma 3) makes the sliding-window mask
through `create_causal_mask`, whose packed-row path remaps query and key indices to in-document positions
before its `or_mask_function` (the blocks) reads them, so the image blocks of every document after a row's first
are looked up at the wrong tokens. Here every condition reads row indices, which within one document differ by a
constant from in-document positions, so each document's mask is exactly its own unpacked one:

    full_attention:     same document  and  (causal  or  same block)
    sliding_attention:  that  and  kv_idx > q_idx - sliding_window

(transformers' unpacked `AND(sliding_window, OR(causal, blockwise))`). Dense [B, 1, S, S] masks for sdpa and
eager, as transformers' own packed-row masks are; a BlockMask for flex_attention.
"""

from __future__ import annotations

from typing import Any

import torch


def packed_block_masks(
    text_config: Any,
    attn_implementation: str,
    position_ids: torch.Tensor,
    blocks: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The per-layer-type masks of [B, S] rows of packed documents (`position_ids`: each document counts from 0)
    with `blocks` ([B, S] block ids, -1 outside a block: spindle.ops.windowed_attention.block_ids; None: none).

    `text_config`: the decoder's transformers config (`layer_types`, `sliding_window`); `dtype`: the eager
    mask's (the model's activations'). The sliding mask is present when the config has sliding layers."""
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        and_masks,
        blockwise_overlay,
        causal_mask_function,
        find_packed_sequence_indices,
        or_masks,
        packed_sequence_mask_function,
        sliding_window_overlay,
    )

    rows, length = position_ids.shape
    allowed = causal_mask_function if blocks is None else or_masks(causal_mask_function, blockwise_overlay(blocks))
    documents = find_packed_sequence_indices(position_ids)
    if documents is not None:
        allowed = and_masks(allowed, packed_sequence_mask_function(documents))
    if attn_implementation not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"model.attn_implementation resolved to {attn_implementation!r}, which takes no attention mask; packed rows "
            "with bidirectional image blocks need one: set model.attn_implementation: sdpa (or auto)"
        )
    make = ALL_MASK_ATTENTION_FUNCTIONS[attn_implementation]

    def build(mask_function: Any) -> Any:
        return make(
            batch_size=rows,
            q_length=length,
            kv_length=length,
            mask_function=mask_function,
            attention_mask=None,
            allow_is_causal_skip=False,
            dtype=dtype,
            config=text_config,
            device=position_ids.device,
        )

    masks = {"full_attention": build(allowed)}
    if "sliding_attention" in (getattr(text_config, "layer_types", None) or ()):
        masks["sliding_attention"] = build(and_masks(allowed, sliding_window_overlay(text_config.sliding_window)))
    return masks
