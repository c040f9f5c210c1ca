"""Default-on speed-ups that keep the output within 1e-5..1e-4 of diffusers (off with `exact=True`).

- `onednn_conv3d(vae)`: on CPU, PyTorch's convolution dispatcher sends a batch-1 3-D convolution with
  few channels (Wan's causal VAE decodes one latent frame at a time with 8-96 channels) to its
  reference kernel `slow_conv3d` (im2col + GEMM) instead of oneDNN; its heuristic looks at
  `N*C*D*H < 20480`, which such inputs always are. Calling oneDNN's convolution directly is ~7x
  faster per layer here (measured: [1, 8, 6, 130, 130] x [8, 8, 3, 3, 3]: 153 ms -> 22 ms, one
  thread) and agrees to float32 rounding (relative ~3e-6 per layer).
- `onednn_linear_gelu(transformer, pairs)`: on CPU, a Linear followed by a GELU (the feed-forward
  input projection of every DiT block) runs as one oneDNN matmul with GELU as its post-op instead of
  an MKL GEMM and a second pass over a [tokens, 4 x dim] tensor. Measured on the flux-cpu preset's
  transformer step: 285 -> 266 ms (1.07x), output within 1e-6 of the unfused pair.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F


def _onednn_conv_forward(
    conv: torch.nn.Conv3d,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if input.device.type != "cpu" or input.dtype != torch.float32 or torch.is_grad_enabled():
            return F.conv3d(input, weight, bias, conv.stride, conv.padding, conv.dilation, conv.groups)
        padding = cast(tuple[int, ...], conv.padding)  # onednn_conv3d only patches convs with tuple padding
        return torch.mkldnn_convolution(input, weight, bias, padding, conv.stride, conv.dilation, conv.groups)

    return forward


def onednn_conv3d(module: torch.nn.Module) -> int:
    """Route the zero-padded `Conv3d`s under `module` through oneDNN on CPU float32 (inference only).
    -> how many convolutions were switched. A no-op where oneDNN is unavailable or on other devices."""
    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Conv3d) and m.padding_mode == "zeros" and isinstance(m.padding, tuple):
            # instance attribute: shadows nn.Conv3d._conv_forward (setattr: mypy rejects assigning to a method)
            setattr(m, "_conv_forward", _onednn_conv_forward(m))  # noqa: B010
            count += 1
    return count


def memoize_constant_inputs(modules: list[torch.nn.Module], slots: int = 2) -> None:
    """Reuse a module's output when it is called again with a bitwise-equal input (inference only).

    Meant for modules whose input is the same for every denoising step of a request (Wan: the text
    projection and each cross-attention's key/value projections of the prompt embeddings): they are
    computed once per request and branch instead of once per step, with the same result by
    construction (a hit needs `torch.equal` inputs). `slots` keeps cond and uncond apart when CFG
    runs two forwards. `clear_memos` frees the entries after a request.
    """
    for module in modules:
        if hasattr(module, "_spindle_memo"):
            continue
        original = module.forward
        entries: list[tuple[torch.Tensor, torch.Tensor]] = []

        def forward(
            x: torch.Tensor,
            _original: Callable[..., Any] = original,
            _entries: list[tuple[torch.Tensor, torch.Tensor]] = entries,
        ) -> torch.Tensor:
            if torch.is_grad_enabled():
                result: torch.Tensor = _original(x)
                return result
            for inp, out in _entries:
                if inp is x or (
                    inp.shape == x.shape and inp.dtype == x.dtype and inp.device == x.device and torch.equal(inp, x)
                ):
                    return out
            out = cast(torch.Tensor, _original(x))
            _entries.insert(0, (x, out))
            del _entries[slots:]
            return out

        # instance attributes; setattr because mypy rejects assigning to a method and types
        # nn.Module.__setattr__ values as Tensor | Module. nn.Module.__call__ dispatches to `forward`.
        setattr(module, "forward", forward)  # noqa: B010
        setattr(module, "_spindle_memo", entries)  # noqa: B010


def clear_memos(root: torch.nn.Module) -> None:
    for m in root.modules():
        memo = getattr(m, "_spindle_memo", None)
        if memo is not None:
            memo.clear()


def _fused_linear_gelu(
    linear: torch.nn.Linear, approximate: str, activation: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
            return activation(F.linear(x, linear.weight, linear.bias))
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, x.shape[-1]), linear.weight, linear.bias, "gelu", [], approximate
        )
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return forward


def onednn_linear_gelu(module: torch.nn.Module, pairs: Sequence[tuple[torch.nn.Module, str, str]] = ()) -> int:
    """Fuse Linear -> GELU under `module` into one oneDNN call on CPU float32 inference (elsewhere the
    pair runs as before). Found: diffusers' `GELU` activation modules (`proj` + gelu: the feed-forward
    of Wan, Flux's double-stream and Qwen-Image blocks), plus `pairs` the family names as (owner,
    linear attribute, GELU attribute) where the two are separate modules (Flux's single-stream
    `proj_mlp` -> `act_mlp`): the linear then applies the GELU and the activation becomes Identity.
    Only plain `nn.Linear`s (not LoRA-wrapped ones). -> how many pairs were fused."""
    from diffusers.models.activations import GELU as DiffusersGELU

    if not torch.backends.mkldnn.is_available():
        return 0
    count = 0
    for m in module.modules():
        if isinstance(m, DiffusersGELU) and type(m.proj) is torch.nn.Linear and not hasattr(m, "_spindle_fused"):
            gelu = m.gelu
            setattr(m, "forward", _fused_linear_gelu(m.proj, m.approximate, gelu))  # noqa: B010
            setattr(m, "_spindle_fused", True)  # noqa: B010
            count += 1
    for owner, linear_name, act_name in pairs:
        linear, act = getattr(owner, linear_name), getattr(owner, act_name)
        if type(linear) is not torch.nn.Linear or not isinstance(act, torch.nn.GELU):
            continue
        setattr(linear, "forward", _fused_linear_gelu(linear, act.approximate, act))  # noqa: B010
        setattr(linear, "_spindle_fused_into", (owner, linear_name, act_name, act))  # noqa: B010 - for unfuse
        setattr(owner, act_name, torch.nn.Identity())
        count += 1
    return count


def unfuse_wrapped_linear_gelu(module: torch.nn.Module) -> int:
    """Undo `onednn_linear_gelu` where a LoRA layer now wraps the fused Linear (a LoRA loaded after the
    engine was built: `spindle.infer.adapters`). The fused call reads the Linear's own weight and would
    skip the adapter (diffusers' GELU) or add it after the GELU (a separate pair); unfused, the pair runs
    as stock diffusers runs it. Plain Linears stay fused. -> how many pairs were unfused."""
    from diffusers.models.activations import GELU as DiffusersGELU

    count = 0
    for m in list(module.modules()):
        if isinstance(m, DiffusersGELU) and getattr(m, "_spindle_fused", False) and type(m.proj) is not torch.nn.Linear:
            del m.forward  # the instance attribute: the class's forward (proj, then gelu) again
            del m._spindle_fused
            count += 1
        fused_into = getattr(m, "_spindle_fused_into", None)
        if fused_into is not None:
            owner, linear_name, act_name, act = fused_into
            if getattr(owner, linear_name) is not m:  # wrapped (the LoRA layer's base_layer is `m`)
                del m.forward
                del m._spindle_fused_into
                setattr(owner, act_name, act)
                count += 1
    return count
