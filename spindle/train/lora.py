"""LoRA through PEFT: which modules get adapters, injecting them, and reading the trained adapter back.

Model-kind neutral: it needs a torch model with PEFT's injection hooks (diffusers' `add_adapter`, or
plain `peft.inject_adapter_in_model`) and the list of its repeated blocks (`find_blocks`), so a
causal-LM task can use it the same way the flow-matching task does.

Targets. `train.lora.targets` entries are module-name suffixes (PEFT's rule: a module matches when
its name equals the entry or ends with "." + entry), resolved here against the `nn.Linear` modules
inside the transformer blocks to a list of full module names. PEFT is then given those exact names:
a suffix like "proj_out" would otherwise also hit a top-level module of the same name (Flux's output
projection, which the sequence-parallel plan hooks). The default is every `nn.Linear` in the blocks
except the adaptive-norm modulation (`norm*` names): the attention and feed-forward projections.

Fused experts. A mixture-of-experts layer holds its experts as 3-D parameters of one module
(transformers' `Qwen3MoeExperts`: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), not as linear
layers. An entry naming such a parameter (`experts.gate_up_proj`, `experts.down_proj`) or its module
(`experts`: all of its 3-D parameters) adapts it through PEFT's own `LoraConfig(target_parameters=...)`
(`peft.tuners.lora.ParamWrapper`: one rank-r adapter per expert), then held expert-major under PEFT's
names (spindle.train.expert_lora: what shards with the experts under `parallel.ep`) and exported in
PEFT's layout (`lora_A [r*E, in]`, `lora_B [out, r*E]`), which stock PEFT loads. PEFT does not support
dropout on them. They are opt-in: the default stays the linear layers.

Names PEFT re-targets. On transformers 5, PEFT rewrites the targets of the MoE model types whose
experts transformers fuses on load (its v4 -> v5 conversion, `convert_peft_config_for_transformers`):
any target named `gate_proj` / `up_proj` / `down_proj` / `gate` becomes the fused routed experts'
parameters, matched by the leaf name alone. On DeepSeek-V3 that catches the shared experts and the dense
layers' MLP: stock PEFT would put those adapters on the routed experts instead, in training and again
when it loads the export. So such linear layers are left out of the default targets, and an entry
naming them is refused with the reason (`peft_retargeted`).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from spindle.config import ConfigError

ADAPTER = "default"  # PEFT's default adapter name (diffusers' loaders use it too)


def block_linears(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """Full names of the `nn.Linear` modules inside `blocks`, in model order."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]


def _relative(name: str) -> str:
    """'blocks.3.attn1.to_q' -> 'attn1.to_q' (the name inside its block, for messages and defaults)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[i + 1 :]) or name  # a layer named by its index (a Sequential's mlp.0)
    return name


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


@dataclasses.dataclass(frozen=True)
class LoraTargets:
    """What LoRA adapts: full names of linear modules (PEFT's `target_modules`) and of fused expert
    parameters (`target_parameters`, `<module>.<parameter>`)."""

    modules: list[str]
    parameters: list[str] = dataclasses.field(default_factory=list)


def block_expert_parameters(model: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """Full names (`<module>.<parameter>`) of the fused expert parameters inside `blocks`, in model order:
    the 3-D parameters of a module that declares `num_experts` (transformers' experts modules do; a DiT
    block's 3-D `scale_shift_table` is no expert stack)."""
    inside = {id(m) for block in blocks for m in block.modules()}
    return [
        f"{name}.{pname}"
        for name, m in model.named_modules()
        if id(m) in inside and hasattr(m, "num_experts")
        for pname, p in m.named_parameters(recurse=False)
        if p.ndim == 3
    ]


def resolve_targets(model: nn.Module, blocks: Sequence[nn.Module], targets: Sequence[str] | None) -> LoraTargets:
    """Full names of the modules and fused expert parameters to adapt (module docstring); an entry
    matching nothing names the closest module names."""
    linears = block_linears(model, blocks)
    retargeted = peft_retargeted(model, linears)
    if not targets:
        default = [
            n for n in linears if not any(p.startswith("norm") for p in _relative(n).split(".")) and n not in retargeted
        ]
        if not default:
            raise ConfigError(f"{type(model).__name__}: no linear layers in its blocks to put LoRA adapters on")
        return LoraTargets(default)
    experts = block_expert_parameters(model, blocks)
    modules: list[str] = []
    parameters: list[str] = []
    relative = sorted({_relative(n) for n in linears + experts})
    for target in targets:
        hits = [n for n in linears if _matches(n, target)]
        # an expert parameter by its name, or every one of a module named by `target`
        params = [n for n in experts if _matches(n, target) or _matches(n.rpartition(".")[0], target)]
        if not hits and not params:
            close = difflib.get_close_matches(target, relative, n=5, cutoff=0.4) or relative[:8]
            raise ConfigError(
                f"train.lora.targets: {target!r} matches no linear layer or fused expert parameter in the "
                f"transformer blocks of {type(model).__name__}; closest names: {', '.join(close)}"
            )
        refused = [n for n in hits if n in retargeted]
        if refused:
            raise ConfigError(
                f"train.lora.targets: {target!r} names {_relative(refused[0])} (and {len(refused) - 1} more), "
                f"which stock PEFT re-targets to the fused routed experts on a {getattr(model.config, 'model_type', '')} model "
                "(its transformers-v4 MoE name conversion matches the leaf name), so the adapter would neither "
                "train nor load where named; adapt the routed experts with `experts`, or leave these layers out"
            )
        modules.extend(n for n in hits if n not in modules)
        parameters.extend(n for n in params if n not in parameters)
    return LoraTargets(modules, parameters)


def peft_retargeted(model: nn.Module, linears: list[str]) -> set[str]:
    """The linear layers among `linears` that stock PEFT would not adapt as named on this model: its own
    config conversion (module docstring) run on a probe config targeting all of them."""
    if not hasattr(getattr(model, "config", None), "model_type") or not linears:
        return set()
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    probe = LoraConfig(target_modules=list(linears))
    convert_peft_config_for_transformers(probe, model=model, conversions=None)
    return set(linears) - set(probe.target_modules or ())


def peft_config(rank: int, alpha: float | None, dropout: float, targets: LoraTargets) -> Any:
    from peft import LoraConfig

    if rank <= 0:
        raise ConfigError(f"train.lora.rank must be a positive integer; got {rank}")
    if dropout and targets.parameters:
        raise ConfigError(
            f"train.lora.dropout={dropout}: PEFT's adapters on fused expert parameters "
            f"({_relative(targets.parameters[0])}, ...) take no dropout; set train.lora.dropout: 0 or leave the "
            "experts out of train.lora.targets"
        )
    return LoraConfig(
        r=rank,
        # PEFT annotates lora_alpha as int but scales by alpha / r in float; a float alpha works
        lora_alpha=float(alpha if alpha is not None else rank),  # type: ignore[arg-type]
        lora_dropout=dropout,
        # None, not []: PEFT accepts no target_modules only when target_parameters are given
        target_modules=targets.modules or None,
        target_parameters=targets.parameters or None,
        init_lora_weights=True,  # B = 0: training starts exactly at the base model
    )


def apply_lora(model: nn.Module, blocks: Sequence[nn.Module], cfg: Any) -> nn.Module:
    """Inject LoRA adapters (`cfg`: rank, alpha, dropout, targets) and freeze everything else, in place.

    Call before sequence parallel, activation checkpointing and FSDP2 (PEFT wraps the Linear modules;
    FSDP2 then shards base and adapter parameters of each block together, base ones frozen).
    """
    config = peft_config(cfg.rank, cfg.alpha, cfg.dropout, resolve_targets(model, blocks, cfg.targets))
    model.requires_grad_(False)
    add_adapter = getattr(model, "add_adapter", None)
    if callable(add_adapter):  # diffusers / transformers models
        add_adapter(config, adapter_name=ADAPTER)
    else:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model, ADAPTER)
    if config.target_parameters:
        from spindle.train.expert_lora import unwrap_param_wrappers

        unwrap_param_wrappers(model)  # the fused experts' adapters expert-major, the experts back in place
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_name(name))
    return model


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every LoRA adapter: A uniform in +-1/sqrt(in_features) (PEFT's default, kaiming-uniform
    with a=sqrt(5)), B zero (training starts exactly at the base model), each A from a generator keyed on
    (seed, module name). Keyed, not drawn from the global RNG in injection order, so that the values do
    not depend on where the adapters were created: on the host (full load) or on the meta device, then
    materialised shard by shard (sharded load: PEFT puts adapters on their base layer's device). Each
    rank computes an adapter's full A (rank x in_features, small) and keeps its own shard. An expert-major
    adapter (spindle.train.expert_lora) gets the values of PEFT's `lora_A [r*E, in]` under the same name,
    stacked `[E, r, in]`: the same initial model as stock PEFT's."""
    from peft.tuners.lora import LoraLayer

    from spindle.train.expert_lora import expert_adapters, factors

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            layer: Any = module  # PEFT's LoraLayer: its adapter dicts are not typed as modules of Linear
            _init_pair(name, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, seed)
    for name, (holder, _) in expert_adapters(model).items():
        _init_pair(name, *factors(holder), seed)


def _init_pair(name: str, a: torch.Tensor, b: torch.Tensor, seed: int) -> None:
    """A (2-D, or expert-major `[E, r, in]` drawn as PEFT's `[r*E, in]`) from the keyed generator, B zero."""
    from spindle.distributed.sharded_load import local_region

    digest = hashlib.blake2b(f"lora:{seed}:{name}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
    bound = 1.0 / math.sqrt(a.shape[-1])
    full = torch.empty((math.prod(a.shape[:-1]), a.shape[-1])).uniform_(-bound, bound, generator=generator)
    local, region = local_region(a)
    local.copy_(full.reshape(a.shape)[region])
    local_region(b)[0].zero_()


def wrapped_parameters(model: nn.Module) -> dict[str, str]:
    """{adapter module name: full name of the parameter it adapts} of the fused experts' adapters, under
    PEFT's names: several parameters of one module nest (`experts.base_layer` wraps the first, `experts`
    the next)."""
    from spindle.train.expert_lora import expert_adapters

    out: dict[str, str] = {}
    for name, (_, spec) in expert_adapters(model).items():
        experts = name.removesuffix(spec.path).rstrip(".")
        out[name] = f"{experts}.{spec.parameter}"
    return out


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_scale(model: nn.Module) -> dict[str, float]:
    """{module name: alpha / r} of every adapted module (the factor PEFT applies to B @ A)."""
    from peft.tuners.lora import LoraLayer

    from spindle.train.expert_lora import expert_adapters

    scales = {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    return scales | {name: spec.scaling for name, (_, spec) in expert_adapters(model).items()}


def checkpoint_adapters(checkpoint: Any, lora: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A LoRA run's adapters in diffusers' layout (`adapter_state_dict`), read by name from a saved
    checkpoint (`lora`: the run's recorded `train.lora`); no model is built. Every adapted module has
    the run's alpha / rank (`peft_config` sets one for all)."""
    from spindle.distributed import checkpoint as ckpt

    scale = float(lora["alpha"] if lora.get("alpha") is not None else lora["rank"]) / lora["rank"]
    names = [n for n in ckpt.saved_model_tensors(checkpoint) if is_lora_name(n)]
    return adapter_state_dict(
        ckpt.read_model_tensors(checkpoint, names), {n.partition(".lora_")[0]: scale for n in names}
    )


def adapter_state_dict(full: dict[str, torch.Tensor], scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """Trained adapter weights in diffusers' LoRA layout, with alpha / r folded into `lora_B`.

    `full`: a (gathered) state dict holding at least the adapter tensors (PEFT names,
    `<module>.lora_A.default.weight`). -> `<module>.lora_A.weight` / `<module>.lora_B.weight`.
    Folding the scale in makes the file mean the same thing to every loader (diffusers assumes
    alpha = rank without metadata; the original-layout converters fold alpha the same way). A fused
    experts' adapter (3-D: expert-major, spindle.train.expert_lora) is written in PEFT's 2-D layout.
    """
    from spindle.train.expert_lora import to_peft_layout

    out: dict[str, torch.Tensor] = {}
    for key, value in full.items():
        if not is_lora_name(key):
            continue
        module, _, rest = key.partition(".lora_")
        kind, adapter, param = rest.split(".", 2)  # "A", "default", "weight"
        if adapter != ADAPTER:
            continue
        tensor = value.detach().to("cpu", torch.float32).clone()
        if tensor.ndim == 3:
            tensor = to_peft_layout(kind, tensor)
        if kind == "B":
            tensor = tensor * scales[module]
        out[f"{module}.lora_{kind}.{param}"] = tensor.contiguous()
    if not out:
        raise ValueError("the model holds no LoRA adapter weights to export")
    return out


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block `model` computes as its base model: every PEFT LoRA layer's adapters off and the stacked
    expert adapters not merged. The reference of a LoRA run's preference or RL objective (DPO, GRPO's KL) with no
    second copy of the weights. Only the flags PEFT's forward reads are switched (PEFT's `enable_adapters` would
    also change `requires_grad`, which FSDP2's sharded parameters must keep)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from spindle.train.expert_lora import ADAPTERS_OFF

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    token = ADAPTERS_OFF.set(True)
    try:
        for m in layers:
            m._disable_adapters = True
        yield
    finally:
        ADAPTERS_OFF.reset(token)
        for m, was in zip(layers, before, strict=True):
            m._disable_adapters = was
