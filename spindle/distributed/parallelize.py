"""The one parallelize path every training task takes (issue 23.4), in torchtitan's order:

    sequence parallel (Ulysses / ring, if sp x ring > 1; else the plan's attention implementation)
        -> expert parallel (if ep > 1)
        -> activation checkpointing -> regional compile -> FSDP2 (experts, blocks, root; world > 1)

What differs by model is a `ParallelPlan` (spindle.contracts.parallel) the task gives: whose SP and
checkpointing hooks the model takes (diffusers or transformers), an optional CP plan, whether the
experts are sharded, and the blocks. The meshes come from `spindle.distributed.mesh.build_mesh`.
The path works on a model whose parameters are on the meta device (sharded loading,
spindle.distributed.sharded_load): nothing here reads a parameter value.

No diffusers or transformers import: the hooks are the model's own methods.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from spindle.contracts.parallel import ParallelPlan
from spindle.distributed.blocks import compile_blocks
from spindle.distributed.fsdp import apply_fsdp, mp_policy, offload_policy
from spindle.distributed.mesh import Mesh


def parallelize(
    model: nn.Module,
    mesh: Mesh,
    plan: ParallelPlan,
    *,
    mixed_precision: str | None = "no",
    gradient_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Apply the plan in place on every rank, before the optimizer is built; -> the model.

    Feed every rank of an SP group the same batch. `cpu_offload` (FSDP2's CPUOffloadPolicy) applies
    FSDP2 even on one process: offloading is done by FSDP2's units.
    """
    policy = mp_policy(mixed_precision)  # validate before any work
    dims = mesh.dims
    if dims.cp_size > 1 and plan.library == "diffusers":
        from spindle.distributed.context_parallel import enable_sequence_parallel

        enable_sequence_parallel(model, mesh.cp, plan=plan.cp_plan)
    elif plan.library == "transformers" and (dims.cp_size > 1 or plan.attention):
        target = model.get_submodule(plan.sequence_parallel_module) if plan.sequence_parallel_module else model
        if dims.cp_size > 1:
            from spindle.distributed import ulysses_attention

            ulysses_attention.enable_sequence_parallel(target, mesh.sp, inner=plan.attention or None)
        else:
            from spindle.ops.varlen_attention import use_attention

            use_attention(target, plan.attention)
    if plan.expert_parallel and dims.ep > 1:
        from spindle.distributed.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh)
    if gradient_checkpointing:
        apply_activation_checkpointing(model, plan.library)
    if compile:
        compile_blocks(model, plan.blocks)
    if mesh.world.size() == 1 and not cpu_offload:  # nothing to shard (spindle.distributed.fsdp)
        return model
    if plan.expert_parallel and dims.ep > 1:
        from spindle.distributed.expert_parallel import shard_experts

        # the experts' own units first, inside their blocks
        shard_experts(model, mesh, policy, offload_policy(cpu_offload, mesh.shard.device_type))
    return apply_fsdp(model, mesh, mixed_precision, reshard_after_forward, plan.blocks, cpu_offload=cpu_offload)


def apply_activation_checkpointing(model: nn.Module, library: str) -> nn.Module:
    """Recompute each block in backward, through the model library's own checkpointing.

    Why the libraries' own rather than torch's `checkpoint_wrapper`: they checkpoint exactly one
    block per call (the model's forward wraps each block), use non-reentrant
    `torch.utils.checkpoint` around `block.__call__` so FSDP2's per-block all-gather hooks fire again
    in the recomputation, keep parameter names unchanged (`checkpoint_wrapper` inserts
    `_checkpoint_wrapped_module.` into every FQN, which would leak into optimizer state, DCP keys and
    export), and leave the modules the CP plan hooks into (`blocks.0`, `rope`, `proj_out`) in place.
    The CP split of `blocks.0` runs inside the recomputed region, which is fine: it is a local slice,
    not a collective; the Ulysses all-to-alls inside attention re-run in the same order on every rank.
    """
    hooks: Any = model  # a diffusers ModelMixin / transformers PreTrainedModel: their API is not on nn.Module
    if library == "transformers":
        hooks.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model
    if not getattr(model, "_supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support gradient checkpointing (diffusers "
            f"`_supports_gradient_checkpointing` is False); set train.gradient_checkpointing: false"
        )
    hooks.enable_gradient_checkpointing()
    return model


def parallelize_transformer(
    transformer: nn.Module,
    mesh: Mesh,
    *,
    mixed_precision: str | None = "no",
    gradient_checkpointing: bool = False,
    compile: bool = False,
    cp_plan: dict[str, Any] | None = None,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """`parallelize` with a diffusers transformer's plan (tests, benches, the conformance suite)."""
    return parallelize(
        transformer,
        mesh,
        ParallelPlan("diffusers", cp_plan=cp_plan),
        mixed_precision=mixed_precision,
        gradient_checkpointing=gradient_checkpointing,
        compile=compile,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
    )
