"""FSDP2 (`fully_shard`) and gradient clipping. The order FSDP2 is applied in, after SP, EP,
activation checkpointing and compile, is spindle.distributed.parallelize's.

FSDP2 shards over `dp_shard x ring x sp` ("fsdp" mesh); with `dp_replicate > 1` it is HSDP over the 2-D
(dp_replicate, fsdp) mesh. On a 1-process world there is nothing to shard and it is skipped:
measured with bench/train.py on CPU, FSDP2 on one rank cost 10% (Wan-shaped, 36M params) to 26%
(Flux-shaped) of a step for identical math. bf16 then runs under `torch.autocast` (`autocast_dtype`)
instead of `MixedPrecisionPolicy`. DCP checkpoints stay interchangeable across world sizes (DCP
reshards plain tensors and DTensors alike; tested by resuming 1 -> 2 and 2 -> 1 processes).

Gradient scaling with SP (the one place it is handled): FSDP2 divides the summed gradient by the
number of ranks it reduces over, `dp_replicate x dp_shard x sp`. The ranks of one SP group hold the
same sample; each computes the loss on the full (gathered) output but back-propagates only through
its own sequence chunk (diffusers' `AllGatherFunction.backward` returns the local chunk of the
gradient, and the Ulysses all-to-all backward routes the rest), so the SP ranks' gradients *sum* to
the gradient of that sample. Averaging them would halve it; the divide factor must be the number of
distinct samples' ranks, `dp_replicate x dp_shard`. Checked numerically in
tests/distributed/test_distributed_parallel.py against single-process gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from spindle.distributed.blocks import find_blocks
from spindle.distributed.mesh import Mesh

MIXED_PRECISION = ("no", "fp32", "bf16")


def mp_policy(mixed_precision: str | None) -> MixedPrecisionPolicy:
    """FSDP2's mixed-precision policy for `train.mixed_precision`; raises on an unknown value."""
    mp = (mixed_precision or "no").lower()
    if mp not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
    if mp == "bf16":
        # bf16 compute copies of the params, fp32 gradient reduction (and fp32 sharded master params).
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # fp32 compute. FSDP2 leaves fp32 parameters alone (param_dtype equal to theirs is no cast) and upcasts
    # a frozen one stored narrower (a bf16 checkpoint's LoRA base, spindle.train.precision.frozen_storage)
    # at its all-gather, so every block computes in fp32. Inputs are not cast: fp32 runs feed what they feed.
    return MixedPrecisionPolicy(param_dtype=torch.float32, cast_forward_inputs=False)


def offload_policy(cpu_offload: bool, device_type: str) -> OffloadPolicy:
    """`train.cpu_offload`: FSDP2's CPUOffloadPolicy keeps the sharded parameters, their gradients and
    hence the optimizer state in host memory; each unit's shards are copied to the device for its
    all-gather, gradients come back after the reduce-scatter, and the optimizer steps on the host.
    Pinned host memory (asynchronous copies) needs an accelerator; on a CPU-only machine host and
    device are the same and the policy only changes where FSDP2 keeps its buffers (same numbers)."""
    if not cpu_offload:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=device_type == "cuda")


def apply_fsdp(
    transformer: nn.Module,
    mesh: Mesh,
    mixed_precision: str | None = "no",
    reshard_after_forward: bool = True,
    block_names: tuple[str, ...] = (),
    cpu_offload: bool = False,
) -> nn.Module:
    """FSDP2 `fully_shard` on each repeated block, then on the root (in place; returns the model).
    `cpu_offload`: shards, gradients and optimizer state in host memory (`offload_policy`)."""
    dmesh = mesh.shard
    policy = mp_policy(mixed_precision)
    offload = offload_policy(cpu_offload, dmesh.device_type)
    for block in find_blocks(transformer, block_names):
        fully_shard(
            block, mesh=dmesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, offload_policy=offload
        )
    # Root too with an explicit flag: FSDP2's default (None) keeps the root's params unsharded after
    # forward, so after a no-grad forward (validation, sampling) `model.parameters()` would be plain
    # tensors until the next backward, and a state dict taken then would not be sharded.
    fully_shard(
        transformer, mesh=dmesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, offload_policy=offload
    )

    dp_size = mesh.dims.dp_size
    if dp_size != dmesh.size():  # sp > 1: divide by the data-parallel size only (module docstring)
        for module in transformer.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(dp_size))
                if dmesh.device_type == "cpu":
                    # CPU/gloo workaround: a custom divide factor makes FSDP2 reduce-scatter with
                    # ReduceOp.PREMUL_SUM, which gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with
                    # Gloo"); sum-only collectives + FSDP's own post-division give the same result.
                    module.set_force_sum_reduction_for_comms(True)
    return transformer


def autocast_dtype(transformer: nn.Module, mixed_precision: str | None) -> torch.dtype | None:
    """The dtype to autocast the forward to when no FSDP2 MixedPrecisionPolicy casts it (one process)."""
    if mixed_precision == "bf16" and not isinstance(transformer, FSDPModule):
        return torch.bfloat16
    return None


def clip_grad_norm_tensor_(
    parameters: Iterable[torch.Tensor], max_norm: float | None, norm_type: float = 2.0
) -> torch.Tensor:
    """`clip_grad_norm_` without reading the norm on the host: the norm stays a (replicated, full)
    tensor and the clipping coefficient is applied on the device (torch's `clip_grads_with_norm_`,
    DTensor-aware), so the training step queues the optimizer update without waiting; the caller
    reads the norm once, when it logs it."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    meshes = {p.grad.device_mesh if isinstance(p.grad, DTensor) else None for p in params}
    if len(meshes) > 1:
        # DTensor grads on several meshes (expert parallelism: dense FSDP2 units and the experts'
        # efsdp x ep units): one foreach norm cannot mix them; `clip_grad_norm_` combines per-mesh
        # norms (one host read).
        return torch.tensor(clip_grad_norm_(params, max_norm, norm_type))
    grads = [cast(torch.Tensor, p.grad) for p in params]  # params holds only those with a grad
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False)
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.full_tensor() if isinstance(total, DTensor) else total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float | None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> float:
    """Total gradient norm (over all ranks' shards) as a float, the same on every rank; clip if max_norm.

    `torch.nn.utils.get_total_norm` handles FSDP2 DTensor grads (a DTensor norm with a pending
    reduction); `.full_tensor()` completes it over the mesh. Scaling the grads by a Python float
    works for DTensor and plain grads alike. `max_norm` None or <= 0: only measure.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # One norm per device mesh (FSDP2's dense units and, with expert parallelism, the experts' 2-D
    # efsdp x ep units are DTensors on different meshes, which one foreach norm cannot mix), each
    # completed over its mesh, then the norm of those norms.
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=norm_type, error_if_nonfinite=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type=norm_type)
    total_norm = float(total.item())
    if error_if_nonfinite and not math.isfinite(total_norm):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite ({total_norm})")
    if max_norm is not None and max_norm > 0 and math.isfinite(total_norm):
        coef = max_norm / (total_norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
    return total_norm


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full gradient} with DTensor grads gathered (collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        # full_tensor() may alias the local shard (no communication when the mesh dims are size 1): clone.
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
