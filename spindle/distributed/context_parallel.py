"""Ulysses sequence parallelism (SP) for DiTs through diffusers' own context-parallel machinery.

diffusers models carry a `_cp_plan` (which inputs to split along the sequence, which output to
gather) and their attention dispatcher implements Ulysses all-to-all with a real backward
(`TemplatedUlyssesAttention` in `diffusers.models.attention_dispatch`; the native/SDPA backend
used on CPU recomputes SDPA under autograd in `_native_attention_backward_op`). Spindle only
points that machinery at *its* mesh: the `sp` sub-mesh of the training/inference mesh, so SP
composes with FSDP over `dp_shard x sp`.

Every workaround for diffusers' accelerator assumptions lives in this module, each marked
`CPU/gloo workaround` with the reason, each covered by tests/test_distributed_parallel.py:

1. `ModelMixin._resolve_parallel_config` derives the device as
   `rank % torch.accelerator.device_count()`, a ZeroDivisionError on a CPU-only machine, and it
   would build its own ("ring", "ulysses") mesh over the whole world when given none. We resolve
   the config ourselves (same steps: `ParallelConfig.setup` with our mesh) and let the rest of
   `enable_parallelism` (backend check, processors, `apply_context_parallel`) run unchanged.

Gradient scaling (see `spindle.distributed.fsdp`): every rank of an SP group computes the loss on
the full gathered output, but `AllGatherFunction.backward` hands each rank only the gradient of
its own sequence chunk, so the *sum* of the SP ranks' parameter gradients is the full gradient.
FSDP must therefore divide by the data-parallel size only, not by `dp_shard x sp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

_HEAD_KEYS = ("num_attention_heads", "num_heads", "heads")


def _config_of(transformer_or_config: Any) -> Mapping[str, Any]:
    if isinstance(transformer_or_config, torch.nn.Module):
        return dict(getattr(transformer_or_config, "config", {}) or {})
    return dict(transformer_or_config or {})


def _model_class(transformer_or_config: Any) -> type | None:
    if isinstance(transformer_or_config, torch.nn.Module):
        return type(transformer_or_config)
    name = _config_of(transformer_or_config).get("_class_name")
    if not name:
        return None
    import diffusers

    return getattr(diffusers, name, None)


def _cp_plan_of(transformer_or_config: Any) -> dict[str, Any] | None:
    cls = _model_class(transformer_or_config)
    if isinstance(transformer_or_config, torch.nn.Module):
        plan = getattr(transformer_or_config, "_cp_plan", None)
    else:
        plan = getattr(cls, "_cp_plan", None) if cls is not None else None
    return plan or None


def check_sequence_parallel(
    transformer_config: Any, sp: int, seq_len: int | None = None, *, plan: dict[str, Any] | None = None
) -> None:
    """Fail fast (ValueError) if `sp`-way Ulysses SP cannot run this transformer; no-op for sp == 1.

    `transformer_config`: the transformer module, its diffusers config, or the `config.json` dict
    (with `_class_name`, used to find the class' `_cp_plan`). `seq_len`: the number of tokens after
    patchify, when known (it must split evenly over the SP ranks). `plan`: an explicit
    context-parallel plan for a family whose diffusers class has none.
    """
    if sp < 1:
        raise ValueError(f"parallel.sp must be >= 1, got {sp}")
    if sp == 1:
        return
    cfg = _config_of(transformer_config)
    cls = _model_class(transformer_config)
    cls_name = cls.__name__ if cls is not None else cfg.get("_class_name", type(transformer_config).__name__)
    if plan is None and _cp_plan_of(transformer_config) is None:
        raise ValueError(
            f"parallel.sp={sp} was requested, but {cls_name} has no context-parallel plan (`_cp_plan`), so this "
            f"family cannot run sequence parallel; set parallel.sp: 1 or pass a plan to enable_sequence_parallel(..., plan=...)"
        )
    heads_key = next((k for k in _HEAD_KEYS if isinstance(cfg.get(k), int)), None)
    if heads_key is not None and cfg[heads_key] % sp:
        heads = cfg[heads_key]
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{cls_name} has {heads} attention heads ({heads_key}), which is not divisible by parallel.sp={sp}: "
            f"Ulysses SP gives each SP rank heads/sp heads; set parallel.sp to a divisor of {heads} ({divisors})"
        )
    if seq_len is not None and seq_len % sp:
        raise ValueError(
            f"the sequence has {seq_len} tokens, which is not divisible by parallel.sp={sp}: each SP rank holds an "
            f"equal slice of the sequence; change the resolution/frame count so the token count is a multiple of {sp}, "
            f"or set parallel.sp to a divisor of {seq_len}"
        )


def check_split_inputs(transformer: torch.nn.Module, sp: int, inputs: Mapping[str, Any]) -> None:
    """The forward inputs the plan splits at the model's entry (e.g. Flux's text tokens and ids) must
    divide evenly over the SP ranks; ValueError naming the input otherwise (diffusers would assert)."""
    if sp == 1:
        return
    from diffusers.models._modeling_parallel import ContextParallelInput

    entry = (_cp_plan_of(transformer) or {}).get("", {})
    for name, spec in entry.items():
        value = inputs.get(name)
        if not (isinstance(spec, ContextParallelInput) and isinstance(value, torch.Tensor)):
            continue
        if value.ndim != spec.expected_dims:  # diffusers skips the split too (e.g. a 1-D timestep)
            continue
        length = value.shape[spec.split_dim]
        if length % sp:
            raise ValueError(
                f"sequence parallel splits the input '{name}' along dim {spec.split_dim}, which has length "
                f"{length}, not divisible by parallel.sp={sp}; make it a multiple of {sp} (for text inputs: "
                f"model.max_text_length) or set parallel.sp to a divisor of {length}"
            )


def _local_device(sp_mesh: DeviceMesh) -> torch.device:
    if sp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(sp_mesh.device_type)


def _ring_ulysses_mesh(sp_mesh: DeviceMesh) -> DeviceMesh:
    """Our 1-D `sp` mesh as the 2-D ("ring", "ulysses") = (1, sp) mesh diffusers' config expects.

    `ContextParallelConfig.setup` slices `mesh["ring", "ulysses"]` and flattens it; `_unflatten`
    keeps the same ranks (and root mesh) as `sp_mesh`, so the Ulysses all-to-all runs exactly over
    the SP group of the Spindle mesh. It is a collective: every rank calls it.
    """
    if sp_mesh.ndim != 1:
        raise ValueError(f"the sequence-parallel mesh must be 1-D, got {sp_mesh.ndim}-D {sp_mesh.mesh_dim_names}")
    return sp_mesh._unflatten(0, (1, sp_mesh.size()), ("ring", "ulysses"))


def enable_sequence_parallel(
    transformer: torch.nn.Module, sp_mesh: DeviceMesh, plan: dict[str, Any] | None = None
) -> torch.nn.Module:
    """Apply diffusers' Ulysses context parallelism over `sp_mesh` (degree = its size), in place.

    Uses the model's `_cp_plan` unless `plan` is given. A no-op when the SP size is 1. Call it
    before FSDP (`fully_shard`) and on every rank (mesh set-up is collective). All ranks of the
    SP group must then be fed the same full-length inputs; each returns the full output.
    """
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    sp = sp_mesh.size()
    if sp == 1:
        return transformer
    check_sequence_parallel(transformer, sp, plan=plan)
    if not hasattr(transformer, "enable_parallelism"):
        raise ValueError(
            f"{type(transformer).__name__} is not a diffusers ModelMixin; Spindle's sequence parallelism uses "
            f"diffusers' context-parallel hooks and attention dispatcher"
        )

    cp_mesh = _ring_ulysses_mesh(sp_mesh)
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=sp, mesh=cp_mesh))

    def resolve_on_our_mesh(_config: Any) -> ParallelConfig:
        # CPU/gloo workaround (1): diffusers' `_resolve_parallel_config` computes the device as
        # `rank % torch.accelerator.device_count()` (ZeroDivisionError without an accelerator) and
        # builds a world-wide mesh when none is given. Do its job with our mesh and local device.
        config.setup(dist.get_rank(), dist.get_world_size(), _local_device(sp_mesh), mesh=cp_mesh)
        transformer._parallel_config = config
        return config

    # An instance attribute shadows the method for this one call only; removed right after.
    transformer.__dict__["_resolve_parallel_config"] = resolve_on_our_mesh
    model: Any = transformer  # a diffusers ModelMixin (checked above); its API is not on nn.Module
    try:
        model.enable_parallelism(config=config, cp_plan=plan)
    finally:
        transformer.__dict__.pop("_resolve_parallel_config", None)
    return transformer


def sequence_parallel_size(transformer: torch.nn.Module) -> int:
    """The Ulysses degree applied to `transformer` (1 when SP is off)."""
    config = getattr(transformer, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    return int(cp.ulysses_degree) if cp is not None else 1
