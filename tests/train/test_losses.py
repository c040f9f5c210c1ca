"""linear_cross_entropy / causal_lm_loss equal plain cross-entropy on full logits, without materialising them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from spindle.ops.losses import causal_lm_loss, linear_cross_entropy

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(n=37, h=16, v=50, seed=0, ignore_every=4, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, requires_grad=True)
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::ignore_every] = -100
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_(True) if bias else None
    return hidden, weight, labels, b


def _reference(hidden, weight, labels, reduction, bias=None):
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction=reduction)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 1000])  # 5, 16 do not divide 37; 1000 > N
def test_loss_and_grads_equal_full_logits_cross_entropy(reduction, chunk_size):
    hidden, weight, labels, _ = _inputs()
    ref = _reference(hidden, weight, labels, reduction)
    ref_grads = _grads(ref, (hidden, weight))
    out = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(_grads(out, (hidden, weight)), ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_bias_and_leading_batch_dims_and_upstream_grad_scale():
    hidden, weight, labels, bias = _inputs(n=24, bias=True)
    hidden3, labels3 = hidden.view(2, 12, -1), labels.view(2, 12)
    ref = _reference(hidden, weight, labels, "mean", bias) * 3.0
    out = linear_cross_entropy(hidden3, weight, labels3, reduction="mean", chunk_size=7, bias=bias) * 3.0
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(_grads(out, (hidden, weight, bias)), _grads(ref, (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_all_ignored_gives_zero_loss_and_zero_grads(reduction):
    hidden, weight, labels, _ = _inputs()
    labels[:] = -100
    out = linear_cross_entropy(hidden, weight, labels, reduction=reduction, chunk_size=8)
    assert out.item() == 0.0 and not torch.isnan(out)
    gh, gw = _grads(out, (hidden, weight))
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_custom_ignore_index():
    hidden, weight, labels, _ = _inputs()
    labels[labels == -100] = 7  # 7 is now the ignored class
    ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=7, reduction="mean")
    out = linear_cross_entropy(hidden, weight, labels, ignore_index=7, reduction="mean", chunk_size=6)
    torch.testing.assert_close(out, ref, **TOL)


def test_bf16_inputs_upcast_logits_like_the_reference():
    hidden, weight, labels, _ = _inputs(n=40, h=32, v=64)
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    ref = F.cross_entropy((hb @ wb.T).float(), labels, reduction="sum")
    out = linear_cross_entropy(hb, wb, labels, reduction="sum", chunk_size=9)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    gh, gw = _grads(out, (hb, wb))
    rh, rw = _grads(ref, (hb, wb))
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), rh.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=2e-2)


def test_no_grad_and_frozen_weight_compute_only_what_is_needed():
    hidden, weight, labels, _ = _inputs()
    with torch.no_grad():
        out = linear_cross_entropy(hidden, weight, labels, reduction="mean", chunk_size=5)
    assert not out.requires_grad
    torch.testing.assert_close(out, _reference(hidden, weight, labels, "mean").detach(), **TOL)
    frozen = weight.detach()
    out = linear_cross_entropy(hidden, frozen, labels, reduction="sum", chunk_size=5)
    (gh,) = _grads(out, (hidden,))
    (rh,) = _grads(_reference(hidden, frozen, labels, "sum"), (hidden,))
    torch.testing.assert_close(gh, rh, **TOL)


class _LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward kernels alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_never_materialises_full_logits_in_forward_or_backward():
    n, h, v, chunk = 2048, 8, 4096, 256
    hidden, weight, labels, _ = _inputs(n=n, h=h, v=v)
    with _LargestAllocation() as probe:
        loss = linear_cross_entropy(hidden, weight, labels, reduction="mean", chunk_size=chunk)
        loss.backward()
    assert probe.largest <= chunk * v < n * v
    # The probe does see a full-logits computation (so the bound above can fail).
    with _LargestAllocation() as probe:
        _reference(hidden, weight, labels, "mean").backward()
    assert probe.largest >= n * v


def test_bad_arguments_name_the_problem():
    hidden, weight, labels, _ = _inputs()
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(hidden, weight, labels, reduction="none")
    with pytest.raises(ValueError, match="labels shape"):
        linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)


# causal_lm_loss: transformers' ForCausalLMLoss semantics from hidden states.


def _causal_inputs():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9), generator=g)
    labels[0, :3] = -100
    return hidden, weight, labels


def _stock_loss(hidden, weight, labels, **kwargs):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(hidden @ weight.T, labels, vocab_size=weight.shape[0], **kwargs)


@pytest.mark.parametrize("num_items", [None, 11, torch.tensor(5)])
def test_causal_lm_loss_equals_transformers_for_causal_lm_loss(num_items):
    hidden, weight, labels = _causal_inputs()
    ref = _stock_loss(hidden, weight, labels, num_items_in_batch=num_items)
    out = causal_lm_loss(hidden, weight, labels=labels, num_items_in_batch=num_items, chunk_size=4)
    torch.testing.assert_close(out, ref, **TOL)
    for got, want in zip(_grads(out, (hidden, weight)), _grads(ref, (hidden, weight)), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_causal_lm_loss_shift_labels_and_sum_reduction():
    hidden, weight, labels = _causal_inputs()
    shifted = torch.roll(labels, 1, dims=1)
    ref = _stock_loss(hidden, weight, labels, shift_labels=shifted)
    out = causal_lm_loss(hidden, weight, labels=labels, shift_labels=shifted, chunk_size=5)
    torch.testing.assert_close(out, ref, **TOL)
    total = causal_lm_loss(hidden, weight, shift_labels=shifted, num_items_in_batch=99, loss_reduction="sum")
    want = F.cross_entropy((hidden @ weight.T).view(-1, 40), shifted.view(-1), reduction="sum")
    torch.testing.assert_close(total, want, **TOL)
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        causal_lm_loss(hidden, weight, labels=labels, loss_reduction="avg")
    with pytest.raises(ValueError, match="labels"):
        causal_lm_loss(hidden, weight)


def test_final_logit_softcapping_equals_the_capped_logits_loss_and_log_probs():
    """A head's `final_logit_softcapping` (Gemma's `softcap * tanh(logits / softcap)`): the chunked loss and the
    chunked per-token log-probs (at a sampling temperature) equal those of the capped full logits, gradients
    included, and the cap changes the result."""
    from spindle.ops.losses import linear_log_probs

    torch.manual_seed(0)
    hidden = (torch.randn(10, 16) * 3).requires_grad_(True)
    weight = (torch.randn(40, 16) * 3).requires_grad_(True)
    labels = torch.randint(0, 40, (10,))
    labels[2] = -100
    capped = lambda: 5.0 * torch.tanh(hidden @ weight.T / 5.0)  # noqa: E731
    for chunk in (3, 1024):
        ours = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk, softcap=5.0)
        ours_grads = torch.autograd.grad(ours, (hidden, weight))
        ref = F.cross_entropy(capped(), labels, ignore_index=-100, reduction="sum")
        ref_grads = torch.autograd.grad(ref, (hidden, weight))
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        for a, b in zip(ours_grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        lp = linear_log_probs(hidden, weight, labels, chunk_size=chunk, temperature=0.7, softcap=5.0)
        ref_lp = torch.log_softmax(capped() / 0.7, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
        ref_lp = torch.where(labels == -100, torch.zeros_like(ref_lp), ref_lp)
        lp_grads = torch.autograd.grad(lp.sum(), (hidden, weight))
        ref_lp_grads = torch.autograd.grad(ref_lp.sum(), (hidden, weight))
        torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
        for a, b in zip(lp_grads, ref_lp_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    plain = linear_cross_entropy(hidden, weight, labels)
    assert not torch.allclose(plain, ref)
