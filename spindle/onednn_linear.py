"""Training linears on CPU through oneDNN: forward and both backward GEMMs.

On CPU, `nn.Linear` (and its backward, `mm` for the input and weight gradients) runs on MKL's
sgemm. On the AMD EPYC this project is measured on, MKL's float32 GEMM reaches about 130-160
GFLOP/s on a DiT block's shapes ([1024 tokens, 512] x [512, 512 | 2048]) while oneDNN's JIT kernels,
which pick their code by instruction set (AVX-512 here) rather than by CPU vendor, reach about 190-200
on the same shapes and two threads (`torch.ops.mkldnn._linear_pointwise`). Once compiled blocks
have removed the elementwise overhead, the linears are ~60% of a CPU training step, so this is the
largest remaining lever there.

`use_onednn_linears(model)` turns every plain `nn.Linear` under `model` into `OneDNNLinear` (a
subclass with the same parameters and names: checkpoints, export, PEFT and FSDP2 see no change),
whose forward calls the `spindle::onednn_linear` custom op on CPU float32 and `F.linear`
everywhere else (CUDA, bf16, DTensor weights, empty inputs). The custom op has its own backward:
input gradient `dY @ W` and weight gradient `dY^T @ X`, both as oneDNN matmuls; inner products
want the reduced dimension contiguous, so the transposed operands are copied first, which measured
cheaper than leaving the weight gradient on MKL. A custom op is opaque to `torch.compile`, so
compiled blocks keep it as one extern call and fuse the elementwise work around it.

The numbers differ from MKL's only by float32 summation order (relative ~1e-6 per layer); losses
agree with `F.linear` training within 1e-5 relative (tests/test_onednn_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["OneDNNLinear", "onednn_available", "use_onednn_linears"]


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _inner_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ b) through oneDNN; both operands contiguous."""
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return y


@torch.library.custom_op("spindle::onednn_mm_nt", mutates_args=())
def _mm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [N, K]^T -> [M, N] (the backward GEMMs)."""
    return _inner_product(a.contiguous(), b.contiguous(), None)


@_mm_nt.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[0])


@torch.library.custom_op("spindle::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for CPU float32 `x` [..., K] through oneDNN."""
    y = _inner_product(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), bias)
    return y.view(*x.shape[:-1], weight.shape[0])


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None  # type: ignore[attr-defined]


def _backward(
    ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
    needs = ctx.needs_input_grad  # type: ignore[attr-defined]
    dy2 = dy.reshape(-1, dy.shape[-1])
    dx = dw = db = None
    if needs[0]:  # dX = dY @ W: W^T [K, N] as the "weight"
        dx = _mm_nt(dy2, weight.t()).view(x.shape)
    if needs[1]:  # dW = dY^T @ X: reduce over the tokens
        dw = _mm_nt(dy2.t(), x.reshape(-1, x.shape[-1]).t())
    if ctx.has_bias and needs[2]:  # type: ignore[attr-defined]
        db = dy2.sum(0)
    return dx, dw, db


onednn_linear.register_autograd(_backward, setup_context=_setup_context)


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    return DTensor


_DTENSOR = _dtensor_type()


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose CPU float32 forward and backward GEMMs run on oneDNN (module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if (
            input.device.type == "cpu"
            and input.dtype == torch.float32
            and w.dtype == torch.float32
            and input.dim() >= 2
            and input.numel() > 0
            and not (_DTENSOR is not None and isinstance(w, _DTENSOR))
        ):
            y: torch.Tensor = onednn_linear(input, w, b)
            return y
        return F.linear(input, w, b)


def use_onednn_linears(module: nn.Module) -> int:
    """Make every plain `nn.Linear` under `module` a `OneDNNLinear` (in place; parameters, names and
    state-dict keys unchanged). Subclasses of `nn.Linear` (LoRA layers, quantized linears) are left
    alone; their plain inner linears are converted. -> how many were converted (0 where oneDNN is
    unavailable)."""
    if not onednn_available():
        return 0
    count = 0
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDNNLinear
            count += 1
    return count
