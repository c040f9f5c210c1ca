"""Expert parallelism (EP) for MoE transformers models, on Spindle's mesh.

Layout. `parallel.ep` divides the FSDP ranks `dp_shard x ring x sp` (the flattened "fsdp" mesh),
viewed as (efsdp, ep) (ep inner: with SP the EP group spans the SP ranks of the same rows first, as
torchtitan borrows EP from dp_shard x cp). Every rank routes its own tokens (its rows, or with SP its
slice of them); the dense parameters stay FSDP2-sharded over the whole "fsdp" mesh as in the dense
path. Each MoE layer's stacked experts (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) become
DTensors sharded on the expert dim over the `ep` mesh (a rank holds E/ep whole experts), and FSDP2
shards those again over the `efsdp` ranks that hold the same experts (2-D: FSDP over efsdp x EP, as
FSDP2 composes with TP), replicated over `dp_replicate` (HSDP, 3-D). DCP saves and loads the DTensors
at any layout, so a checkpoint resumes at another `ep`. LoRA adapters of the fused experts are held
stacked by expert (spindle.train.expert_lora) and sharded the same way (`_shard_stacked`). (Carving EP
out of dp_shard alone, with the experts sharded over efsdp x sp, gives the same gradients, but that
flattened mesh interleaves with `ep` in the root mesh's dim order and DTensor cannot take the gradient
norm on the combined mesh.)

Token exchange: transformers' own EP building blocks (transformers.distributed.expert_parallel):
`MoEParamShard` shards the expert weights and sets the module's local expert count, and
`EpDispatchExpertsParallel` wraps the experts' forward with `AllToAllEP` (each (token, expert) pair
sent to the expert's rank with `all_to_all_single_autograd`, the experts run there through the
module's own `use_experts_implementation` kernel (grouped_mm) on local expert ids, the outputs sent
back, weighted and summed on the sender; the collectives are differentiable). We do not go through
`from_pretrained(distributed_config=...)`: that path builds its own device mesh and its own FSDP2 plan
at load time, while Spindle's mesh, FSDP2 units, gradient scaling and DCP checkpoints must cover the
experts too (docs/training.md, "Mixture of experts").

Gradient scaling: an expert's gradient on its EP rank sums the contributions of the tokens of every
rank of its EP group; FSDP2 then reduces over efsdp (and dp_replicate): every rank's tokens once.
The trainer scales each rank's loss by dp_size / tokens, so the reduction must divide by dp_size,
not by the efsdp size FSDP2 would use: the experts' FSDP units get `set_gradient_divide_factor(dp_size)`.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

from spindle.contracts.protocols import ParallelDimsLike
from spindle.distributed.mesh import Mesh


def check_ep_layout(dims: ParallelDimsLike, num_experts: int) -> None:
    """Layouts EP supports (before launch); raises ValueError naming the field."""
    if dims.ep == 1:
        return
    if num_experts % dims.ep:
        raise ValueError(
            f"parallel.ep={dims.ep} must divide the model's num_experts={num_experts} (each EP rank holds whole experts)"
        )


def _ep_meshes(mesh: Mesh) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """-> (ep, efsdp, one) of the mesh (built by spindle.distributed.mesh.build_mesh when ep > 1)."""
    if mesh.ep is None or mesh.efsdp is None or mesh.ep_one is None:
        raise ValueError("expert parallelism needs parallel.ep > 1 (the mesh has no expert-parallel sub-meshes)")
    return mesh.ep, mesh.efsdp, mesh.ep_one


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: experts module} of the MoE layers (the modules the config's EP plan names "ep_dispatch_experts")."""
    plan = _ep_plan(model)
    patterns = [f"*{p}" for p, style in plan.items() if style == "ep_dispatch_experts"]
    return {n: m for n, m in model.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)}


def ep_plan_of(config: Any) -> dict[str, str]:
    """A transformers config's expert-parallel plan ({name pattern: style}; empty if it declares none)."""
    # a VLM declares the plan on its text config (patterns relative to its language model)
    plan: dict[str, str] | None = getattr(config, "base_model_ep_plan", None) or getattr(
        config.get_text_config(), "base_model_ep_plan", None
    )
    return dict(plan or {})


def _ep_plan(model: nn.Module) -> dict[str, str]:
    plan = ep_plan_of(model.config)
    if not plan:
        raise ValueError(f"{type(model).__name__} declares no expert-parallel plan (config.base_model_ep_plan)")
    return plan


def apply_expert_parallel(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Shard the experts over `ep` and install the all-to-all dispatch (in place; before FSDP2)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    ep, _, one = _ep_meshes(mesh)
    plan = _ep_plan(model)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_modules()]
    # transformers' plan uses "layers.*" patterns relative to the base model: expand to this model's names.
    concrete = {
        name: style for pattern, style in plan.items() for name in names if fnmatch.fnmatchcase(name, f"*{pattern}")
    }
    apply_expert_parallelism(model, ep, one, concrete, ep_implementation="all_to_all")
    for name, experts in expert_modules(model).items():
        _shard_stacked(name, experts, ep)
    return model


def _shard_stacked(name: str, experts: nn.Module, ep: DeviceMesh) -> None:
    """Shard every parameter the plan left whole inside an experts module on its expert dim, as the plan
    shards the weights: the fused experts' LoRA adapters, held stacked by expert `[E, ...]`
    (spindle.train.expert_lora), so that each rank holds the adapters of its own experts. A parameter not
    stacked by expert cannot be split that way: an error naming it."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    sharded = [p for p in experts.parameters(recurse=False) if isinstance(p, DTensor)]
    if not sharded:
        raise ValueError(f"{name}: the expert-parallel plan sharded none of its parameters")
    num_experts = sharded[0].shape[0]
    for sub, module in experts.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if param.ndim == 0 or param.shape[0] != num_experts:
                where = ".".join(filter(None, (name, sub, pname)))
                raise ValueError(
                    f"{where} {tuple(param.shape)}: a parameter inside the experts module must be stacked by "
                    f"expert ([{num_experts}, ...]) to be split over parallel.ep"
                )
            local = distribute_tensor(param.detach(), ep, [Shard(0)], src_data_rank=None)
            module._parameters[pname] = nn.Parameter(local, requires_grad=param.requires_grad)


def shard_experts(
    model: nn.Module, mesh: Mesh, mp_policy: MixedPrecisionPolicy, offload: OffloadPolicy | None = None
) -> None:
    """FSDP2 units for the experts of each MoE layer over `efsdp` (before the dense `apply_fsdp`);
    `offload`: the dense units' policy (`train.cpu_offload`: the expert shards live in host memory too).

    Gradients divide by the data-parallel size (module docstring); on gloo the custom factor needs
    sum-only collectives (see spindle.distributed.fsdp.apply_fsdp).
    """
    efsdp = _ep_meshes(mesh)[1]
    for experts in expert_modules(model).values():
        sharded = fully_shard(
            experts,
            mesh=efsdp,
            mp_policy=mp_policy,
            reshard_after_forward=True,
            offload_policy=offload or OffloadPolicy(),
        )
        sharded.set_gradient_divide_factor(float(mesh.dims.dp_size))
        if efsdp.device_type == "cpu" and efsdp.size(efsdp.ndim - 1) > 1:
            # gloo has no PREMUL_SUM; but where the shard dim has 1 rank (no reduce-scatter) FSDP2's
            # forced-sum path divides twice (measured: expert grads at 1/dp_size of the 1-process
            # ones; under HSDP the replicate all-reduce still runs, and sums), so only where a
            # reduce-scatter really runs.
            sharded.set_force_sum_reduction_for_comms(True)


def expert_param_names(model: nn.Module) -> list[str]:
    prefixes = tuple(f"{n}." for n in expert_modules(model))
    return [n for n, _ in model.named_parameters() if n.startswith(prefixes)]


def to_full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
