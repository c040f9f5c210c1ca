"""spindle.ops.windowed_attention (the kernel Ulysses SP runs for sliding-window and attention-sink layers) equals
transformers' dense attention with its own masks: sdpa with `create_sliding_window_causal_mask` /
`create_causal_mask` of packed rows (Gemma 3's path), and GPT-OSS's eager attention with sinks; forward and
the gradients of q, k, v (and the sinks), fp32 at 1e-5."""

from __future__ import annotations

import pytest
import torch

from spindle.ops.varlen_attention import document_ids
from spindle.ops.windowed_attention import windowed_attention

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
