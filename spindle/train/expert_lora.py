"""LoRA on fused MoE experts, held expert-major so that it shards with the experts (`parallel.ep`).

PEFT adapts a fused expert parameter (`LoraConfig(target_parameters=...)`) with a `ParamWrapper`:
`lora_A [r*E, in]` holds expert e's A in rows e*r..(e+1)*r, `lora_B [out, r*E]` its B in the columns
j*E + e, and the wrapper parametrizes the weight with `W + scale * B @ A` during its forward. That
does not survive expert parallelism (spindle.distributed.expert_parallel): the wrappers nest around the
experts module, so its weights move under `base_layer.`, where transformers' EP plan does not find them;
the parametrization would hand the experts kernel the global DTensor where it needs this rank's experts;
and lora_B's interleaved columns cannot be split by expert with a DTensor placement.

So `unwrap_param_wrappers`, run right after PEFT's injection (which decides the adapters' names, ranks,
scales and in/out sides), puts the experts module back in place of each wrapper chain and gives it, per
adapted parameter, the same adapter stacked by expert like the weight:

    lora_A [E, r, in]    PEFT's rows e*r + j        -> [e, j, :]
    lora_B [E, out, r]   PEFT's column j*E + e      -> [e, :, j]

under the names PEFT gives them (`experts.lora_A.default.weight` for the outermost wrapper's parameter,
`experts.base_layer.lora_A.default.weight` for the one it wrapped), so checkpoints, the keyed initial
values (spindle.train.lora.init_adapters) and exports name them as stock PEFT does. Every path uses this
layout, one process included, so the step-1 parity with stock PEFT covers it. Under EP every parameter
of the experts module is sharded on its expert dim, adapters included, and the experts' forward
(`adapted_weights`) adds each local expert's `scale * B @ A` to its local weight, in one `baddbmm` as
PEFT's `_LoraFactorsProxy` does, before the experts kernel reads it. Exports convert back to PEFT's
layout (`to_peft_layout`): the file is the one stock PEFT writes and loads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

ADAPTER = "default"  # PEFT's default adapter name (spindle.train.lora.ADAPTER)
_SPECS = "_spindle_expert_lora"  # the experts module's attribute listing its ExpertAdapters
# True within `spindle.train.lora.adapters_disabled`: the experts compute with their base weights only
ADAPTERS_OFF: ContextVar[bool] = ContextVar("spindle_expert_adapters_off", default=False)


@dataclasses.dataclass(frozen=True)
class ExpertAdapter:
    """One adapted parameter of an experts module: `path` is the adapter's module under the experts module
    ("" or "base_layer", ...: PEFT's wrapper name), `transposed` where the module stores it [E, in, out]."""

    parameter: str
    path: str
    scaling: float
    transposed: bool


class Stacked(nn.Module):
    """One factor stacked by expert, as `weight` (PEFT's factors are `nn.Linear`s: `lora_A.default.weight`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


def expert_major(kind: str, tensor: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT's `lora_A [r*E, in]` -> `[E, r, in]`, `lora_B [out, r*E]` -> `[E, out, r]` (`kind`: "A" or "B")."""
    if kind == "A":
        return tensor.reshape(num_experts, -1, tensor.shape[-1]).contiguous()
    return tensor.reshape(tensor.shape[0], -1, num_experts).permute(2, 0, 1).contiguous()


def to_peft_layout(kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of `expert_major`: `[E, r, in]` -> `[r*E, in]`, `[E, out, r]` -> `[out, r*E]`."""
    if kind == "A":
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)


def _holder(experts: nn.Module, path: str) -> nn.Module:
    """The module at `path` under `experts` ("" is `experts`), created empty where missing."""
    module = experts
    for part in filter(None, path.split(".")):
        if part not in module._modules:
            module.add_module(part, nn.Module())
        child = module._modules[part]
        assert child is not None
        module = child
    return module


def unwrap_param_wrappers(model: nn.Module) -> None:
    """Replace every chain of PEFT `ParamWrapper`s by the experts module it wraps, which then holds the
    chain's adapters expert-major under the chain's names and adds them in its forward (module docstring).
    In place; before any parallelism (the forward it installs is what EP's dispatch runs on local experts)."""
    from peft.tuners.lora import ParamWrapper

    wrappers = {name: m for name, m in model.named_modules() if isinstance(m, ParamWrapper)}
    outermost = [n for n in wrappers if not (n.endswith(".base_layer") and n.removesuffix(".base_layer") in wrappers)]
    for name in outermost:
        chain: list[tuple[str, Any]] = []
        module: nn.Module = wrappers[name]
        path = ""
        while isinstance(module, ParamWrapper):
            chain.append((path, module))
            module = module.base_layer
            path = f"{path}.base_layer".lstrip(".")
        experts = module
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).add_module(child, experts)
        specs = []
        for path, wrapper in chain:
            holder = _holder(experts, path)
            for kind in ("A", "B"):
                weight = getattr(wrapper, f"lora_{kind}")[ADAPTER].weight.detach()
                stacked = Stacked(expert_major(kind, weight, wrapper.num_experts))
                holder.add_module(f"lora_{kind}", nn.ModuleDict({ADAPTER: stacked}))
            transposed = bool(getattr(experts, "is_transposed", False))
            specs.append(ExpertAdapter(wrapper.parameter_name, path, float(wrapper.scaling[ADAPTER]), transposed))
        setattr(experts, _SPECS, tuple(specs))
        _install_forward(experts)


def _install_forward(experts: nn.Module) -> None:
    forward = experts.forward  # the class's own, bound now: EP's dispatch later wraps what this installs

    def adapted(*args: Any, **kwargs: Any) -> Any:
        with adapted_weights(experts):
            return forward(*args, **kwargs)

    experts.forward = adapted  # an instance attribute, as transformers' EP dispatch installs its own


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


@contextmanager
def adapted_weights(experts: nn.Module) -> Iterator[None]:
    """For the experts' forward: each adapted parameter replaced by `W + scale * B @ A`, expert by expert.

    `W` is what the module holds now: under EP this rank's experts (transformers' dispatch has swapped its
    parameters for their local tensors), else the whole (FSDP2-gathered) stack; the adapters' local shards
    are the same experts (sharded alike). Autocast off, the factors in W's dtype: PEFT's `_LoraFactorsProxy`."""
    if ADAPTERS_OFF.get():  # the base model (a preference or RL objective's reference)
        yield
        return
    params = experts._parameters
    originals: dict[str, torch.Tensor | None] = {}
    try:
        for spec in getattr(experts, _SPECS):
            a, b = map(_local, factors(experts.get_submodule(spec.path)))
            weight = params[spec.parameter]
            assert weight is not None
            lhs, rhs = (a.mT, b.mT) if spec.transposed else (b, a)
            with torch.autocast(device_type=weight.device.type, enabled=False):
                merged = torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=spec.scaling)
            originals[spec.parameter] = weight
            params[spec.parameter] = merged  # type: ignore[assignment]  # a tensor for this forward only
        yield
    finally:
        params.update(originals)  # type: ignore[arg-type]  # the very objects held before


def factors(holder: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A `[E, r, in]`, lora_B `[E, out, r]`) of an adapter's holder module (`expert_adapters`)."""
    stacks: list[torch.Tensor] = []
    for kind in ("lora_A", "lora_B"):
        factor = holder.get_submodule(f"{kind}.{ADAPTER}")
        assert isinstance(factor, Stacked)
        stacks.append(factor.weight)
    return stacks[0], stacks[1]


def expert_adapters(model: nn.Module) -> dict[str, tuple[nn.Module, ExpertAdapter]]:
    """{PEFT's adapter module name: (its holder module, the adapter)} of every expert-major adapter."""
    out: dict[str, tuple[nn.Module, ExpertAdapter]] = {}
    for name, module in model.named_modules():
        for spec in getattr(module, _SPECS, ()):
            out[".".join(filter(None, (name, spec.path)))] = (module.get_submodule(spec.path), spec)
    return out
