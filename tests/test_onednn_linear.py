"""`spindle.onednn_linear`: CPU float32 linears whose forward and backward GEMMs run on oneDNN agree
with `nn.Linear` (float32 summation order only), really run on oneDNN, compose with torch.compile, and
the trainer's default (`train.onednn_linear`) trains like `F.linear` (losses within 1e-5 relative)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from spindle.onednn_linear import OneDNNLinear, use_onednn_linears
from spindle.train.metrics import read_metrics
from tests.conftest import lm_train


def _pair(in_f: int, out_f: int, bias: bool) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    ref = nn.Linear(in_f, out_f, bias=bias)
    fast = nn.Linear(in_f, out_f, bias=bias)
    fast.load_state_dict(ref.state_dict())
    assert use_onednn_linears(fast) == 1 and type(fast) is OneDNNLinear
    return ref, fast


def _ops(fn) -> dict[str, int]:
    """The ATen / custom ops `fn` ran -> their call counts."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key: e.count for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_equal_nn_linear(bias):
    ref, fast = _pair(96, 160, bias)
    x = torch.randn(2, 37, 96)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad = torch.randn(2, 37, 160)
    yr, yf = ref(xr), fast(xf)
    torch.testing.assert_close(yf, yr, rtol=1e-5, atol=1e-5)
    yr.backward(grad)
    yf.backward(grad)
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(fast.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)


def test_gemms_run_on_onednn_not_mkl():
    _, fast = _pair(64, 128, True)
    x = torch.randn(50, 64, requires_grad=True)
    ops = _ops(lambda: fast(x).sum().backward())
    assert ops["spindle::onednn_linear"] == 1 and ops["spindle::onednn_mm_nt"] == 2, ops  # dX and dW
    assert ops["mkldnn::_linear_pointwise"] == 3, ops
    assert not {"aten::mm", "aten::addmm", "aten::linear"} & set(ops), ops


def test_frozen_weight_and_constant_input_skip_their_gemms():
    ref, fast = _pair(32, 48, True)
    for m in (ref, fast):
        m.weight.requires_grad_(False)
    x = torch.randn(10, 32)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).square().sum().backward()
    fast(xf).square().sum().backward()
    assert fast.weight.grad is None
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.bias.grad, ref.bias.grad, rtol=1e-5, atol=1e-5)
    ops = _ops(lambda: fast(x.clone().requires_grad_()).sum().backward())
    assert ops["spindle::onednn_mm_nt"] == 1, ops  # dX only
    # an input without grad (the first layer): only the weight GEMM runs in the backward
    for m in (ref, fast):
        m.weight.requires_grad_(True)
        m.zero_grad()
    ref(x).sum().backward()
    ops = _ops(lambda: fast(x).sum().backward())
    torch.testing.assert_close(fast.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    assert ops["spindle::onednn_mm_nt"] == 1, ops  # dW only


def test_other_dtypes_and_shapes_fall_back_to_f_linear():
    ref, fast = _pair(16, 8, True)
    for m in (ref, fast):
        m.to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    ops = _ops(lambda: fast(x))
    assert "spindle::onednn_linear" not in ops
    assert torch.equal(fast(x), ref(x))
    ref32, fast32 = _pair(16, 8, True)
    v = torch.randn(16)  # 1-D input: F.linear's vector case
    assert torch.equal(fast32(v), ref32(v))
    empty = torch.randn(0, 16)
    assert fast32(empty).shape == (0, 8)


def test_compiled_module_equals_eager():
    """A custom op is one extern call for inductor: a compiled block with OneDNNLinears (no graph
    break) gives the eager outputs and gradients."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))
    use_onednn_linears(block)
    compiled = torch.compile(block, fullgraph=True)
    x = torch.randn(3, 20, 32)
    eager_out = block(x)
    eager_out.square().mean().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    out = compiled(x)
    out.square().mean().backward()
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    for p, g in zip(block.parameters(), eager_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_swap_keeps_names_and_leaves_linear_subclasses():
    class Quantized(nn.Linear):
        pass

    model = nn.ModuleDict({"a": nn.Linear(4, 4), "inner": nn.Sequential(nn.Linear(4, 2)), "q": Quantized(4, 4)})
    keys = list(model.state_dict())
    assert use_onednn_linears(model) == 2
    assert type(model["a"]) is OneDNNLinear and type(model["inner"][0]) is OneDNNLinear
    assert type(model["q"]) is Quantized
    assert list(model.state_dict()) == keys
    assert use_onednn_linears(model) == 0  # idempotent


def test_trainer_default_uses_onednn_and_trains_like_f_linear(make_config, tmp_path):
    """Wan, fp32 CPU, 3 steps with full fine-tuning: losses and grad norms with the default
    (oneDNN linears) equal `train.onednn_linear: false` within 1e-5 relative."""
    from spindle.train.trainer import Trainer

    common = dict(train__max_steps=3, train__global_batch_size=2, checkpoint__export=False)
    plain = Trainer(make_config(tmp_path / "plain", train__onednn_linear=False, **common))
    assert not any(type(m) is OneDNNLinear for m in plain.model.modules())
    plain.run()
    fast = Trainer(make_config(tmp_path / "fast", **common))
    assert sum(type(m) is OneDNNLinear for m in fast.model.modules()) > 10
    fast.run()
    for key in ("loss", "grad_norm"):
        ref = [m[key] for m in read_metrics(tmp_path / "plain")]
        got = [m[key] for m in read_metrics(tmp_path / "fast")]
        assert got == pytest.approx(ref, rel=1e-5), key


def test_causal_lm_trains_like_f_linear(tiny_qwen3, lm_corpus, tmp_path):
    lm_train(tiny_qwen3, lm_corpus, tmp_path / "plain", train__onednn_linear=False, checkpoint__export=False)
    trainer, _ = lm_train(tiny_qwen3, lm_corpus, tmp_path / "fast", checkpoint__export=False)
    assert type(trainer.model.lm_head) is OneDNNLinear
    for key in ("loss", "grad_norm"):
        ref = [m[key] for m in read_metrics(tmp_path / "plain")]
        got = [m[key] for m in read_metrics(tmp_path / "fast")]
        assert got == pytest.approx(ref, rel=1e-5), key
