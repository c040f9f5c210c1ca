"""The generated (patched) Qwen3/Llama causal LMs equal stock transformers: loss, gradients, logits, generate."""

from __future__ import annotations

import importlib

import pytest
import torch

TOL = {"rtol": 1e-5, "atol": 1e-6}
FAMILIES = {
    "qwen3": ("transformers.Qwen3Config", "transformers.Qwen3ForCausalLM", "Qwen3ForCausalLM"),
    "llama": ("transformers.LlamaConfig", "transformers.LlamaForCausalLM", "LlamaForCausalLM"),
}


def _object(dotted):
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def pair(request):
    """(stock model, generated model) with the same random weights, fp32, eval mode (no dropout)."""
    config_cls, stock_cls, name = FAMILIES[request.param]
    config = _object(config_cls)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=1000,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    stock = _object(stock_cls)(config).eval()
    generated = importlib.import_module(f"spindle.models.{request.param}.generated.patched_modeling_{request.param}")
    patched = getattr(generated, name)(config).eval()
    patched.load_state_dict(stock.state_dict())
    return stock, patched


def _batch(seed=0, batch=2, seq=12, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = input_ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return input_ids, labels


def _loss_and_grads(model, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(stock_kwargs, patched_kwargs, stock, patched):
    want, want_grads = _loss_and_grads(stock, **stock_kwargs)
    got, got_grads = _loss_and_grads(patched, **patched_kwargs)
    torch.testing.assert_close(got.loss, want.loss, **TOL)
    assert got.logits is None  # the loss path never builds [tokens, vocab] logits
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("num_items_in_batch", [None, 13, torch.tensor(7)])
def test_labels_loss_and_grads_equal_stock(pair, num_items_in_batch):
    stock, patched = pair
    input_ids, labels = _batch()
    kwargs = {"input_ids": input_ids, "labels": labels}
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    _assert_same(kwargs, kwargs, stock, patched)


def test_shift_labels_equal_stock(pair):
    stock, patched = pair
    input_ids, labels = _batch(seed=1)
    shift = torch.roll(labels, -1, dims=1)  # already shifted, as Spindle's packed rows arrive
    shift[:, 5] = -100  # a document boundary: nothing to predict across it
    stock_kwargs = {"input_ids": input_ids, "labels": labels, "shift_labels": shift}
    _assert_same(stock_kwargs, {"input_ids": input_ids, "shift_labels": shift}, stock, patched)


def test_loss_reduction_sum_is_the_plain_sum(pair):
    stock, patched = pair
    input_ids, labels = _batch(seed=2)
    shift = torch.roll(labels, -1, dims=1)
    # Stock with num_items_in_batch=1 divides the sum by 1: the plain sum over valid tokens.
    stock_kwargs = {"input_ids": input_ids, "labels": labels, "shift_labels": shift, "num_items_in_batch": 1}
    patched_kwargs = {"input_ids": input_ids, "shift_labels": shift, "loss_reduction": "sum", "num_items_in_batch": 9}
    _assert_same(stock_kwargs, patched_kwargs, stock, patched)


@torch.no_grad()
def test_logits_path_and_generate_unchanged(pair):
    stock, patched = pair
    input_ids, _ = _batch(seed=3)
    want, got = stock(input_ids=input_ids), patched(input_ids=input_ids)
    assert got.loss is None
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    last = patched(input_ids=input_ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, 1000)
    torch.testing.assert_close(last, want.logits[:, -1:], **TOL)
    gen = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(patched.generate(input_ids, **gen), stock.generate(input_ids, **gen))


def test_bad_loss_reduction_names_the_kwarg(pair):
    _, patched = pair
    input_ids, labels = _batch()
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        patched(input_ids=input_ids, labels=labels, loss_reduction="avg")
