"""spindle.ops.windowed_attention (the kernel Ulysses SP runs for sliding-window and attention-sink layers) equals
transformers' dense attention with its own masks: sdpa with `create_sliding_window_causal_mask` /
`create_causal_mask` of packed rows (Gemma 3's path), and GPT-OSS's eager attention with sinks; forward and
the gradients of q, k, v (and the sinks), fp32 at 1e-5."""

from __future__ import annotations

import pytest
import torch

from spindle.ops.varlen_attention import document_ids
from spindle.ops.windowed_attention import block_ids, windowed_attention

B, S, D = 2, 20, 8
DOCS = (9, 7, 4)  # packed documents: borders inside and across the query blocks of the tests (block=6)
WINDOW = 5


def positions(packed: bool) -> torch.Tensor:
    return (torch.cat([torch.arange(n) for n in DOCS]) if packed else torch.arange(S)).expand(B, S)


def dense_mask(packed: bool, window: int | None) -> torch.Tensor:
    """[B, 1, S, S] boolean mask as transformers builds it for a packed row (documents from the position ids)."""
    from transformers import GptOssConfig
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=D, sliding_window=window or S)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(B, S, 8)
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    mask = make(
        config=config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=positions(packed)
    )
    if mask is None:  # transformers leaves a plain causal row to sdpa's is_causal
        mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S)
    return mask


def inputs(heads: int, kv_heads: int, sinks: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(heads + 10 * kv_heads)
    x = {
        "q": torch.randn(B, heads, S, D, generator=g),
        "k": torch.randn(B, kv_heads, S, D, generator=g),
        "v": torch.randn(B, kv_heads, S, D, generator=g),
        "w": torch.randn(B, S, heads, D, generator=g),
    }
    if sinks:
        x["sinks"] = torch.randn(heads, generator=g)
    return x


def grads_of(out: torch.Tensor, x: dict[str, torch.Tensor], leaves: dict[str, torch.Tensor]) -> dict:
    (out * x["w"]).sum().backward()
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}


def reference(x: dict[str, torch.Tensor], packed: bool, window: int | None) -> dict:
    """transformers in one process: sdpa with the dense mask, or GPT-OSS's eager attention with its sinks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    heads, kv_heads = x["q"].shape[1], x["k"].shape[1]
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks") if n in x}
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = heads // kv_heads, True, False
    mask = dense_mask(packed, window)
    if "sinks" in leaves:
        module.sinks = leaves["sinks"]
        additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        out, _ = eager_attention_forward(module, leaves["q"], leaves["k"], leaves["v"], additive, scaling=D**-0.5)
    else:
        out, _ = sdpa_attention_forward(module, leaves["q"], leaves["k"], leaves["v"], mask, scaling=D**-0.5)
    return grads_of(out, x, leaves)


def spindle_kernel(x: dict[str, torch.Tensor], packed: bool, window: int | None) -> dict:
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "sinks") if n in x}
    out = windowed_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        documents=document_ids(positions(packed)),
        window=window,
        sinks=leaves.get("sinks"),
        scaling=D**-0.5,
        block=6,
    )
    return grads_of(out, x, leaves)


@pytest.mark.parametrize("sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("window", [WINDOW, None], ids=["window", "full"])
@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_windowed_attention_equals_transformers_dense_attention(kv_heads, packed, window, sinks):
    x = inputs(4, kv_heads, sinks)
    want, got = reference(x, packed, window), spindle_kernel(x, packed, window)
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def test_window_and_documents_change_the_result():
    """The cases above are real tests: without the window, or across documents, the outputs differ."""
    x = inputs(4, 4, sinks=False)
    windowed = spindle_kernel(x, packed=True, window=WINDOW)["out"]
    assert not torch.allclose(windowed, spindle_kernel(x, packed=True, window=None)["out"], atol=1e-3)
    assert not torch.allclose(windowed, spindle_kernel(x, packed=False, window=WINDOW)["out"], atol=1e-3)


def test_a_rank_slice_of_the_sinks_is_that_slice_of_the_heads():
    """Under Ulysses a rank attends with heads [r * H/sp, (r+1) * H/sp) and their sinks: the output of those
    heads, exactly."""
    x = inputs(4, 2, sinks=True)
    docs = document_ids(positions(True))
    whole = windowed_attention(x["q"], x["k"], x["v"], documents=docs, window=WINDOW, sinks=x["sinks"], block=6)
    for rank in range(2):
        heads = slice(2 * rank, 2 * rank + 2)
        part = windowed_attention(
            x["q"][:, heads],
            x["k"][:, rank : rank + 1],
            x["v"][:, rank : rank + 1],
            documents=docs,
            window=WINDOW,
            sinks=x["sinks"][heads],
            block=6,
        )
        torch.testing.assert_close(part, whole[:, :, heads], rtol=0, atol=0)


def test_windowed_attention_names_bad_arguments():
    x = inputs(4, 2, sinks=True)
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head \(4\)"):
        windowed_attention(x["q"], x["k"], x["v"], documents=None, sinks=x["sinks"][:2])
    with pytest.raises(ValueError, match="sliding window must be >= 1"):
        windowed_attention(x["q"], x["k"], x["v"], documents=None, window=0)


# ---------------------------------------------------------------- bidirectional blocks (Gemma 3's image tokens)

# token_type_ids of the rows: image blocks of 3 and 4 tokens in document 0 (the second across the query-block border
# at 6: a query of the first block attends keys of the next), one of 3 in document 1, none in document 2; the
# second row has one block of 7 tokens (longer than the window: its earliest keys fall out of a late query's window)
IMAGE_SPANS = (((1, 4), (5, 9), (11, 14)), ((2, 9),))


def token_types() -> torch.Tensor:
    types = torch.zeros(B, S, dtype=torch.long)
    for row, spans in enumerate(IMAGE_SPANS):
        for a, b in spans:
            types[row, a:b] = 1
    return types


def gemma3_masks(types: torch.Tensor, window: int, position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """transformers' own masks of Gemma 3 rows with images (`create_masks_for_vision_model`), sdpa; unpacked rows
    unless `position_ids` say otherwise."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    config = Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=D, sliding_window=window)
    config._attn_implementation = "sdpa"
    rows, length = types.shape
    return create_masks_for_vision_model(
        config=config,
        inputs_embeds=torch.zeros(rows, length, 8),
        attention_mask=None,
        past_key_values=None,
        position_ids=torch.arange(length).expand(rows, length) if position_ids is None else position_ids,
        block_sequence_ids=get_block_sequence_ids_for_mask(types),
    )


def test_block_ids_are_transformers_block_sequence_ids():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    types = token_types()
    assert torch.equal(block_ids(types == 1), get_block_sequence_ids_for_mask(types))
    assert block_ids(torch.zeros(B, S, dtype=torch.bool)) is None


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
@pytest.mark.parametrize("layer", ["sliding_attention", "full_attention"])
def test_blocks_equal_gemma3s_own_mask_per_document(layer, packed):
    """Each document of the row (the whole row unpacked) attends as transformers' Gemma 3 mask of that document
    alone: sdpa with `create_masks_for_vision_model`'s mask, forward and q/k/v gradients."""
    x = inputs(4, 2, sinks=False)
    types = token_types()
    window = WINDOW if layer == "sliding_attention" else None
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    out = windowed_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        documents=document_ids(positions(packed)),
        window=window,
        blocks=block_ids(types == 1),
        scaling=D**-0.5,
        block=6,
    )
    got = grads_of(out, x, leaves)

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 2, True, False
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v")}
    parts, start = [], 0
    for n in DOCS if packed else (S,):
        doc = slice(start, start + n)
        mask = gemma3_masks(types[:, doc], WINDOW)[layer]
        q, k, v = (leaves[name][:, :, doc] for name in ("q", "k", "v"))
        parts.append(sdpa_attention_forward(module, q, k, v, mask, scaling=D**-0.5)[0])
        start += n
    want = grads_of(torch.cat(parts, dim=1), x, leaves)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    plain = windowed_attention(x["q"], x["k"], x["v"], documents=document_ids(positions(packed)), window=window)
    assert not torch.allclose(got["out"], plain, atol=1e-3)  # the blocks matter


@pytest.mark.parametrize("layer", ["sliding_attention", "full_attention"])
def test_packed_block_masks_are_each_documents_own_mask(layer):
    """spindle.ops.packed_block_masks on a packed row: each document's square is transformers' Gemma 3 mask of
    that document alone, nothing across documents (transformers' own packed-row sliding mask is not: the case
    that makes it needed)."""
    from transformers import Gemma3TextConfig

    from spindle.ops.packed_block_masks import packed_block_masks

    types = token_types()
    config = Gemma3TextConfig(
        num_attention_heads=4, num_key_value_heads=2, head_dim=D, sliding_window=WINDOW, num_hidden_layers=2
    )
    config.layer_types = ["sliding_attention", "full_attention"]
    mask = packed_block_masks(config, "sdpa", positions(True), block_ids(types == 1))[layer]
    want = torch.zeros(B, 1, S, S, dtype=torch.bool)
    start = 0
    for n in DOCS:
        doc = slice(start, start + n)
        want[:, :, doc, doc] = gemma3_masks(types[:, doc], WINDOW)[layer]
        start += n
    assert torch.equal(mask, want)
    stock = gemma3_masks(types, WINDOW, positions(True))[layer]
    assert torch.equal(stock, want) == (layer == "full_attention")


def test_packed_block_masks_name_an_attention_that_takes_no_mask():
    from transformers import Gemma3TextConfig

    from spindle.ops.packed_block_masks import packed_block_masks

    with pytest.raises(ValueError, match=r"model\.attn_implementation resolved to 'spindle_varlen'.*set model"):
        packed_block_masks(Gemma3TextConfig(), "spindle_varlen", positions(True), block_ids(token_types() == 1))
