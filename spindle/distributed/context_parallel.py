"""Sequence parallelism for DiTs (Ulysses, ring, and both: USP) through diffusers' own context-parallel machinery.

diffusers models carry a `_cp_plan` (which inputs to split along the sequence, which output to
gather) and their attention dispatcher implements Ulysses all-to-all with a real backward
(`TemplatedUlyssesAttention` in `diffusers.models.attention_dispatch`; the native/SDPA backend
used on CPU recomputes SDPA under autograd in `_native_attention_backward_op`). Spindle only
points that machinery at *its* mesh: the `sp` sub-mesh of the training/inference mesh, so SP
composes with FSDP over `dp_shard x sp`.

Ring attention (`parallel.ring`) splits the sequence further without splitting heads: the SP group
is `ring x sp` (Spindle's 2-D "cp" mesh, diffusers' ("ring", "ulysses") mesh). Heads must divide
`sp` only; the token count must divide `ring x sp`. So a 3-head model runs sequence-parallel on 2
processes with ring=2, and Wan2.1-1.3B's 12 heads run on 8 GPUs as sp=4 x ring=2.

Every workaround for diffusers' assumptions lives in this module, each marked `workaround (N)` with
the reason (1 is CPU/gloo only; 2-4 apply on every device), each covered by
tests/distributed/test_distributed_parallel.py or tests/distributed/test_ring_attention.py (canaries fail when diffusers
fixes what they work around):

1. `ModelMixin._resolve_parallel_config` derives the device as
   `rank % torch.accelerator.device_count()`, a ZeroDivisionError on a CPU-only machine, and it
   would build its own ("ring", "ulysses") mesh over the whole world when given none. We resolve
   the config ourselves (same steps: `ParallelConfig.setup` with our mesh) and let the rest of
   `enable_parallelism` (backend check, processors, `apply_context_parallel`) run unchanged.
2. Ring attention needs each block's log-sum-exp, and diffusers' native (SDPA) backend, the only one
   that runs on CPU (and the default on GPU), raises "Native attention does not support
   return_lse=True". `install_sequence_parallel_backend` wraps the native backend: with a ring degree > 1 it runs
   diffusers' own templated ring with per-block ops that return (out, lse) (`_ring_ops`): on CPU
   `aten._scaled_dot_product_flash_attention_for_cpu` and a backward that recomputes each KV block's
   gradient against the global (out, lse), the flash-attention backward; on CUDA in half precision
   diffusers' own cuDNN ring ops (its `_native_cudnn` backend's); otherwise fp32 block math.
   Everything else goes to the native backend unchanged. A call with a key
   mask (Qwen-Image's text padding) takes Spindle's own masked ring instead (see "key masks under
   ring attention" below): diffusers' ring gives every KV chunk the local mask.
3. Under Ulysses, `TemplatedUlyssesAttention` hands SDPA a per-head key mask [B, H, 1, keys] (LTX-2's
   attention processor repeats its text mask per head) with all H heads, though each rank attends with
   H / sp heads after the all-to-all: a broadcast error. `_ulysses_mask` gathers the mask's keys and keeps
   the rank's heads.
4. `TemplatedUlyssesAttention.backward` reshapes the key/value gradients with the queries' local length,
   a shape error for queries and keys of different lengths, both split (LTX-2's text and audio<->video
   cross attentions; Wan's cross attention bypasses SP). Such calls, and those of (3), run
   `_ulysses_attention`: diffusers' differentiable `SeqAllToAllDim` around the native attention, so
   autograd does the backward. (3) and (4) are covered by tests/distributed/test_ltx2_sequence_parallel.py
   (LTX-2 training under parallel.sp: 2 equals one process).

Gradient scaling (see `spindle.distributed.fsdp`): every rank of an SP group computes the loss on
the full gathered output, but `AllGatherFunction.backward` hands each rank only the gradient of
its own sequence chunk, so the *sum* of the SP ranks' parameter gradients is the full gradient.
FSDP must therefore divide by the data-parallel size only, not by `dp_shard x sp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spindle.contracts.family import DiTFamily
from spindle.ops.ring_attention import block_backward, block_forward, merge_blocks

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


def check_family_sequence_parallel(
    family: DiTFamily,
    root: str | Path,
    sp: int,
    ring: int,
    keys: tuple[str, str] = ("parallel.sp: {}", "parallel.ring: {}"),
) -> None:
    """Whether a DiT family's checkpoint at `root` runs `sp`-way Ulysses x `ring`-way ring SP, before a launch or a
    load (training's plan check and `spindle generate` / `serve` alike): what the family refuses, with its reason
    (`DiTFamily.sequence_parallel_refused`, `ring_attention_refused`), then the transformer's own plan and heads
    (`check_sequence_parallel` on `root/transformer/config.json`). ValueError naming the settings asked for, in
    `keys`' words (the job config's by default; the CLI's "--sp {}", "--ring {}"), and what to set instead."""
    if sp * ring == 1:
        return
    import json

    sp_key, ring_key = keys
    asked = " and ".join(k.format(v) for k, v in ((sp_key, sp), (ring_key, ring)) if v > 1)
    if family.sequence_parallel_refused:
        raise ValueError(
            f"{asked}: {family.name} runs without sequence parallelism: {family.sequence_parallel_refused}; set "
            f"{sp_key.format(1)} and {ring_key.format(1)}"
        )
    if ring > 1 and family.ring_attention_refused:
        raise ValueError(
            f"{ring_key.format(ring)}: {family.name} runs without ring attention: {family.ring_attention_refused}; "
            f"set {ring_key.format(1)}"
        )
    config = Path(root) / "transformer" / "config.json"
    if config.is_file():
        try:
            check_sequence_parallel(json.loads(config.read_text()), sp, ring=ring)
        except ValueError as e:
            raise ValueError(f"{asked}: {e}") from None


def check_sequence_parallel(
    transformer_config: Any, sp: int, seq_len: int | None = None, *, plan: dict[str, Any] | None = None, ring: int = 1
) -> None:
    """Fail fast (ValueError) if `sp`-way Ulysses x `ring`-way ring SP cannot run this transformer;
    no-op for sp == ring == 1. Heads must divide `sp`; the sequence must divide `sp x ring`.

    `transformer_config`: the transformer module, its diffusers config, or the `config.json` dict
    (with `_class_name`, used to find the class' `_cp_plan`). `seq_len`: the number of tokens after
    patchify, when known (it must split evenly over the SP ranks). `plan`: an explicit
    context-parallel plan for a family whose diffusers class has none.
    """
    if sp < 1 or ring < 1:
        raise ValueError(f"parallel.sp and parallel.ring must be >= 1, got sp={sp}, ring={ring}")
    if sp * ring == 1:
        return
    what = f"parallel.sp={sp}" + (f" x parallel.ring={ring}" if ring > 1 else "")
    cfg = _config_of(transformer_config)
    cls = _model_class(transformer_config)
    cls_name = cls.__name__ if cls is not None else cfg.get("_class_name", type(transformer_config).__name__)
    if plan is None and _cp_plan_of(transformer_config) is None:
        raise ValueError(
            f"{what} was requested, but {cls_name} has no context-parallel plan (`_cp_plan`), so this family "
            f"cannot run sequence parallel; set parallel.sp: 1 and parallel.ring: 1, or pass a plan to "
            f"enable_sequence_parallel(..., plan=...)"
        )
    heads_key = next((k for k in _HEAD_KEYS if isinstance(cfg.get(k), int)), None)
    if heads_key is not None and cfg[heads_key] % sp:
        heads = cfg[heads_key]
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"{cls_name} has {heads} attention heads ({heads_key}), which is not divisible by parallel.sp={sp}: "
            f"Ulysses SP gives each SP rank heads/sp heads; set parallel.sp to a divisor of {heads} ({divisors}) and "
            f"split the sequence further with parallel.ring (ring attention needs no head split)"
        )
    if seq_len is not None and seq_len % (sp * ring):
        raise ValueError(
            f"the sequence has {seq_len} tokens, which is not divisible by {what} = {sp * ring}: each "
            f"sequence-parallel rank holds an equal slice of the sequence; change the resolution/frame count so "
            f"the token count is a multiple of {sp * ring}, or use degrees whose product divides {seq_len}"
        )


def check_split_inputs(transformer: torch.nn.Module, sp: int, inputs: Mapping[str, Any]) -> None:
    """The forward inputs the plan splits (e.g. Flux's and Qwen-Image's text tokens, Flux's ids) must
    divide evenly over the `sp` sequence-parallel ranks (ring x Ulysses); ValueError naming the input
    otherwise (diffusers would assert)."""
    if sp == 1:
        return
    from diffusers.models._modeling_parallel import ContextParallelInput

    # Entries of the plan name module inputs; those named like a forward input carry its sequence
    # (Flux splits at the model's entry "", Qwen-Image at "transformer_blocks.0" / ".*").
    specs = [(n, s) for entry in (_cp_plan_of(transformer) or {}).values() if isinstance(entry, Mapping)
             for n, s in entry.items() if isinstance(n, str)]  # fmt: skip
    for name, spec in specs:
        value = inputs.get(name)
        if not (isinstance(spec, ContextParallelInput) and isinstance(value, torch.Tensor)):
            continue
        if value.ndim != spec.expected_dims:  # diffusers skips the split too (e.g. a 1-D timestep)
            continue
        length = value.shape[spec.split_dim]
        if length % sp:
            raise ValueError(
                f"sequence parallel splits the input '{name}' along dim {spec.split_dim}, which has length "
                f"{length}, not divisible by the {sp} sequence-parallel ranks (parallel.sp x parallel.ring); make "
                f"it a multiple of {sp} (for text inputs: model.max_text_length) or use degrees dividing {length}"
            )


def _local_device(sp_mesh: DeviceMesh) -> torch.device:
    if sp_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(sp_mesh.device_type)


def _ring_ulysses_mesh(cp_mesh: DeviceMesh) -> DeviceMesh:
    """Our sequence-parallel mesh as the 2-D ("ring", "ulysses") mesh diffusers' config expects.

    `cp_mesh`: 1-D (Ulysses only: ring 1) or Spindle's 2-D ("ring", "sp") mesh. `ContextParallelConfig.setup`
    slices `mesh["ring", "ulysses"]` and flattens it; `_flatten` + `_unflatten` keep the same ranks (and
    root mesh), so the all-to-alls and ring passes run exactly over the SP group of the Spindle mesh.
    It is a collective: every rank calls it.
    """
    if cp_mesh.ndim == 1:
        return cp_mesh._unflatten(0, (1, cp_mesh.size()), ("ring", "ulysses"))
    if cp_mesh.ndim != 2:
        raise ValueError(f"the sequence-parallel mesh must be 1-D or 2-D (ring, sp), got {cp_mesh.mesh_dim_names}")
    ring, ulysses = cp_mesh.size(0), cp_mesh.size(1)
    flat = cp_mesh._flatten("cp_flat")
    return flat._unflatten(0, (ring, ulysses), ("ring", "ulysses"))


def _ring_and_ulysses(cp_mesh: DeviceMesh) -> tuple[int, int]:
    """(ring degree, Ulysses degree) of Spindle's sequence-parallel mesh (1-D: Ulysses only)."""
    return (1, cp_mesh.size()) if cp_mesh.ndim == 1 else (cp_mesh.size(0), cp_mesh.size(1))


def sequence_parallel_config(cp_mesh: DeviceMesh) -> Any:
    """diffusers' `ParallelConfig` for ring x Ulysses over Spindle's sequence-parallel mesh `cp_mesh` (1-D:
    Ulysses; 2-D: ("ring", "sp")), set up on our mesh and local device (collective: every rank calls it).
    What the attention dispatcher receives as `parallel_config`."""
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    ring, sp = _ring_and_ulysses(cp_mesh)
    diffusers_mesh = _ring_ulysses_mesh(cp_mesh)
    config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ring_degree=ring, ulysses_degree=sp, mesh=diffusers_mesh)
    )
    config.setup(dist.get_rank(), dist.get_world_size(), _local_device(cp_mesh), mesh=diffusers_mesh)
    return config


def enable_sequence_parallel(
    transformer: torch.nn.Module, cp_mesh: DeviceMesh, plan: dict[str, Any] | None = None
) -> torch.nn.Module:
    """Apply diffusers' context parallelism over `cp_mesh`, in place: Ulysses over a 1-D mesh, or ring x
    Ulysses over Spindle's 2-D ("ring", "sp") mesh (`Mesh.cp`).

    Uses the model's `_cp_plan` unless `plan` is given (then the instance's `_cp_plan` from now on). A no-op when the mesh has one rank. Call it
    before FSDP (`fully_shard`) and on every rank (mesh set-up is collective). All ranks of the
    SP group must then be fed the same full-length inputs; each returns the full output.
    """
    ring, sp = _ring_and_ulysses(cp_mesh)
    if ring * sp == 1:
        return transformer
    check_sequence_parallel(transformer, sp, plan=plan, ring=ring)
    if not hasattr(transformer, "enable_parallelism"):
        raise ValueError(
            f"{type(transformer).__name__} is not a diffusers ModelMixin; Spindle's sequence parallelism uses "
            f"diffusers' context-parallel hooks and attention dispatcher"
        )
    install_sequence_parallel_backend()
    config = sequence_parallel_config(cp_mesh)

    def resolve_on_our_mesh(_config: Any) -> Any:
        # workaround (1), CPU/gloo: diffusers' `_resolve_parallel_config` computes the device as
        # `rank % torch.accelerator.device_count()` (ZeroDivisionError without an accelerator) and
        # builds a world-wide mesh when none is given. Its job is done by `sequence_parallel_config`.
        transformer._parallel_config = config
        return config

    # An instance attribute shadows the method for this one call only; removed right after.
    transformer.__dict__["_resolve_parallel_config"] = resolve_on_our_mesh
    model: Any = transformer  # a diffusers ModelMixin (checked above); its API is not on nn.Module
    try:
        model.enable_parallelism(config=config, cp_plan=plan)
    finally:
        transformer.__dict__.pop("_resolve_parallel_config", None)
    if plan is not None:  # the plan applied is the one the split checks read (`check_split_inputs`)
        model._cp_plan = plan
    return transformer


def sequence_parallel_degrees(transformer: torch.nn.Module) -> tuple[int, int]:
    """(Ulysses degree, ring degree) applied to `transformer`; (1, 1) when SP is off."""
    config = getattr(transformer, "_parallel_config", None)
    cp = getattr(config, "context_parallel_config", None)
    if cp is None:
        return 1, 1
    return int(cp.ulysses_degree), int(cp.ring_degree)


def sequence_parallel_size(transformer: torch.nn.Module) -> int:
    """How many ranks one sequence is split over (ring x Ulysses; 1 when SP is off)."""
    sp, ring = sequence_parallel_degrees(transformer)
    return sp * ring


# ---------------------------------------------------------------- workaround (2): ring attention's per-block ops


def _ring_forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One ring block: [B, S, H, D] in -> (out [B, S, H, D], lse [B, S, H]): the CPU flash kernel on CPU,
    fp32 block math (`spindle.ops.ring_attention.block_forward`) on other devices."""
    if attn_mask is not None or dropout_p or is_causal or enable_gqa:
        raise ValueError(
            "ring attention supports plain (non-causal, no dropout, no GQA) attention only; "
            "use parallel.ring: 1 (Ulysses only) for this model"
        )
    if _save_ctx:
        ctx.save_for_backward(query, key, value)
        ctx.scale = scale
    if query.device.type == "cpu":
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        out, lse = out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)
    else:
        out, lse = block_forward(query, key, value, None, scale if scale is not None else query.shape[-1] ** -0.5)
        out = out.to(query.dtype)
    return (out, lse) if return_lse else out


def _ring_backward_op(
    ctx: Any,
    grad_out: torch.Tensor,
    *args: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    **kwargs: Any,
) -> tuple[torch.Tensor, ...]:
    """Gradients of one KV block given the global (out, lse) of the whole ring (`spindle.ops.ring_attention.block_backward`)."""
    scale = ctx.scale if ctx.scale is not None else query.shape[-1] ** -0.5
    grads = block_backward(query, key, value, out, grad_out, lse, None, scale)
    return tuple(g.to(query.dtype) for g in grads)


# ---------------------------------------------------------------- key masks under ring attention
#
# diffusers' `TemplatedRingAttention` hands the *local* attn_mask to every KV chunk it visits (wrong as
# soon as the chunk is another rank's) and none to the backward op; and its merge
# `lse = prev_lse - logsigmoid(prev_lse - lse)` is NaN when the first chunk a rank visits has every key
# masked for some query (-inf - -inf). Qwen-Image's joint attention carries a key-padding mask (its text
# padding), so a masked call takes this path instead: the local key mask is all-gathered once over the
# sequence-parallel group, and each KV chunk is attended (forward and backward) with its own slice of it,
# in fp32 explicit math that works on any device; unmasked calls still run diffusers' templated ring.


def _wait(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _gather_kv(key: torch.Tensor, value: torch.Tensor, group: Any, world: int) -> list[tuple[torch.Tensor, ...]]:
    """Every ring rank's (key, value) chunk, in ring-rank order (one all-gather, as diffusers' ring)."""
    from torch.distributed import _functional_collectives as funcol

    flat = torch.cat([key.flatten(), value.flatten()])
    chunks = _wait(funcol.all_gather_tensor(flat, gather_dim=0, group=group)).chunk(world)
    n = key.numel()
    return [(c[:n].view_as(key), c[n:].view_as(value)) for c in chunks]


class _MaskedRingAttention(torch.autograd.Function):
    """Ring attention of the local queries over the KV chunks of every rank of `group`, chunk c masked
    by `mask[..., c * S:(c + 1) * S]` (S: the local KV length; `mask` covers all the ring's keys)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
        group: Any,
    ) -> torch.Tensor:
        world = dist.get_world_size(group)
        out = lse = None
        for (k, v), chunk_mask in zip(_gather_kv(key, value, group, world), mask.chunk(world, -1), strict=True):
            block = block_forward(query, k, v, chunk_mask, scale)
            out, lse = block if out is None or lse is None else merge_blocks(out, lse, *block)
        assert out is not None and lse is not None
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, mask, out, lse)
        ctx.scale, ctx.group, ctx.world = scale, group, world
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        from torch.distributed import _functional_collectives as funcol

        query, key, value, mask, out, lse = ctx.saved_tensors
        grad_q = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        grad_kv = []
        chunks = zip(_gather_kv(key, value, ctx.group, ctx.world), mask.chunk(ctx.world, -1), strict=True)
        for (k, v), chunk_mask in chunks:
            dq, dk, dv = block_backward(query, k, v, out, grad_out, lse, chunk_mask, ctx.scale)
            grad_q += dq
            grad_kv.append(torch.cat([dk.flatten(), dv.flatten()]))
        # Rank r computed every chunk's K/V gradient for its own queries: summed over the ring, chunk c's
        # belongs to rank c (a reduce-scatter of the chunks in rank order).
        mine = _wait(funcol.reduce_scatter_tensor(torch.cat(grad_kv), "sum", scatter_dim=0, group=ctx.group))
        n = key.numel()
        grad_k, grad_v = mine[:n].view_as(key), mine[n:].view_as(value)
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, None, None


def _gather_key_mask(attn_mask: torch.Tensor, key: torch.Tensor, cp: Any) -> torch.Tensor:
    """The local key mask ([B, S_local] or [B|1, 1, 1, S_local]) -> [B|1, 1, 1, S_local x ring x sp]: the
    masks of all sequence-parallel ranks in the flattened ("ring", "ulysses") order the `_cp_plan` split
    the sequence in, which is also the order of the KV chunks the ring visits after the Ulysses
    all-to-all (ring chunk c = the sequences of ranks c x sp ... c x sp + sp - 1)."""
    mask = attn_mask[:, None, None, :] if attn_mask.ndim == 2 else attn_mask
    batch, local = key.shape[0], key.shape[1]
    if mask.ndim != 4 or mask.shape[1:3] != (1, 1) or mask.shape[0] not in (1, batch) or mask.shape[3] != local:
        raise ValueError(
            f"ring attention (parallel.ring > 1) takes a key mask of shape [batch, 1, 1, local keys] = "
            f"[{batch}, 1, 1, {local}] (or [batch, local keys]), got {tuple(attn_mask.shape)}: a per-query or "
            f"per-head mask cannot be split over ring ranks (each holds its own queries' rows for its own keys "
            f"only); use parallel.ring: 1 (Ulysses, parallel.sp) for this model"
        )
    return _all_gather_keys(mask, cp._flattened_mesh.get_group())


def _all_gather_keys(mask: torch.Tensor, group: Any) -> torch.Tensor:
    """A [..., local keys] mask -> [..., local keys x group size]: every rank's, in rank order."""
    from torch.distributed import _functional_collectives as funcol

    # bool travels as uint8 (not every backend reduces/gathers bool).
    wire = mask.to(torch.uint8) if mask.dtype == torch.bool else mask
    full = _wait(funcol.all_gather_tensor(wire.contiguous(), gather_dim=mask.ndim - 1, group=group))
    return full.bool() if mask.dtype == torch.bool else full


def _ulysses_mask(
    attn_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, cp: Any
) -> torch.Tensor | None:
    """workaround (3): the key mask of a Ulysses call for the attention after the all-to-all (this rank's H / sp
    heads over all the keys): a local key mask ([B, local keys] or [B, 1|H, 1, local keys]) gathered over the keys,
    then a per-head mask's rows of this rank's heads.

    After the all-to-all, Ulysses rank r attends with heads r x H/sp ... (r + 1) x H/sp - 1 over the whole
    sequence, but `TemplatedUlyssesAttention` hands SDPA the mask with all H heads (LTX-2's attention processor
    repeats its text mask per head: `prepare_attention_mask`), which does not broadcast against H/sp heads."""
    if attn_mask is None:
        return None
    heads = query.shape[2]
    mask = attn_mask[:, None, None, :] if attn_mask.ndim == 2 else attn_mask
    if mask.ndim != 4 or mask.shape[1] not in (1, heads) or mask.shape[2] != 1:
        raise ValueError(
            f"Ulysses sequence parallelism takes a key mask of shape [batch, keys] or [batch, 1 or heads, 1, keys], "
            f"got {tuple(attn_mask.shape)}: a per-query mask cannot follow the queries' all-to-all; use parallel.sp: 1"
        )
    group = cp._ulysses_mesh.get_group()
    if mask.shape[-1] == key.shape[1]:  # the local keys' mask (as diffusers' own gather decides)
        mask = _all_gather_keys(mask, group)
    if mask.shape[1] == 1 or heads == 1:
        return mask
    local = heads // cp.ulysses_degree
    rank = dist.get_rank(group)
    return mask[:, rank * local : (rank + 1) * local]


def _needs_own_ulysses(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Calls diffusers' `TemplatedUlyssesAttention` gets wrong (workarounds 3 and 4): a per-head mask, or queries
    and keys of different lengths (both split: LTX-2's text and audio<->video cross attentions), whose backward
    reshapes the key gradients with the queries' length (a shape error)."""
    per_head = attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] > 1
    return per_head or query.shape[1] != key.shape[1]


def _ulysses_attention(
    native: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    cp: Any,
) -> torch.Tensor:
    """workaround (4): Ulysses attention ([B, S_local, H, D] in and out) whose backward is autograd's: all-to-all
    to (the whole sequence, H / sp heads) with diffusers' differentiable `SeqAllToAllDim`, the native attention,
    all-to-all back. Queries and keys may have different lengths (each split over the group)."""
    from diffusers.models.attention_dispatch import SeqAllToAllDim

    mask = _ulysses_mask(attn_mask, query, key, cp)
    group = cp._ulysses_mesh.get_group()
    q, k, v = (SeqAllToAllDim.apply(group, x, 2, 1) for x in (query, key, value))
    out = native(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, False, _parallel_config=None)
    result: torch.Tensor = SeqAllToAllDim.apply(group, out, 1, 2)
    return result


def _masked_context_parallel_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor, scale: float | None, cp: Any
) -> torch.Tensor:
    """Key-masked ring attention ([B, S_local, H, D] in and out), composed with Ulysses (USP) as diffusers'
    `_templated_unified_attention`: all-to-all to (all of the ulysses group's sequence, H / sp heads),
    the ring over that, all-to-all back."""
    from diffusers.models.attention_dispatch import SeqAllToAllDim

    mask = _gather_key_mask(attn_mask, key, cp)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    ring = cp._ring_mesh.get_group()
    ring_attention: Any = _MaskedRingAttention.apply  # torch leaves `apply` untyped
    if cp.ulysses_degree == 1:
        out: torch.Tensor = ring_attention(query, key, value, mask, scale, ring)
        return out
    ulysses = cp._ulysses_mesh.get_group()
    q, k, v = (SeqAllToAllDim.apply(ulysses, x, 2, 1) for x in (query, key, value))
    out = SeqAllToAllDim.apply(ulysses, ring_attention(q, k, v, mask, scale, ring), 1, 2)
    return out


def _ring_ops(query: torch.Tensor) -> tuple[Any, Any]:
    """(forward op, backward op) per ring block for `query`'s device and dtype: diffusers' own cuDNN ops on
    CUDA in half precision (what its ring-capable `_native_cudnn` backend runs), else Spindle's."""
    if query.device.type == "cuda" and query.dtype in (torch.float16, torch.bfloat16):
        from diffusers.models import attention_dispatch as ad

        return ad._cudnn_attention_forward_op, ad._cudnn_attention_backward_op
    return _ring_forward_op, _ring_backward_op


def install_sequence_parallel_backend() -> None:
    """Route diffusers' native attention backend through the ring ops of `_ring_ops` when a ring degree > 1
    is configured, and key-masked calls through the masked ring (idempotent; every other call goes to the
    native backend unchanged)."""
    from diffusers.models import attention_dispatch as ad

    registry = ad._AttentionBackendRegistry
    native = registry._backends[ad.AttentionBackendName.NATIVE]
    if getattr(native, "_spindle_ring", False):
        return

    def native_or_ring(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        return_lse: bool = False,
        _parallel_config: Any = None,
    ) -> Any:
        cp = getattr(_parallel_config, "context_parallel_config", None)
        if cp is not None and cp.ring_degree == 1 and not return_lse and _needs_own_ulysses(query, key, attn_mask):
            return _ulysses_attention(native, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cp)
        if cp is None or cp.ring_degree == 1:
            return native(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                          _parallel_config=_parallel_config)  # fmt: skip
        if attn_mask is not None:
            if dropout_p or is_causal or enable_gqa or return_lse:
                raise ValueError(
                    "masked ring attention supports plain (non-causal, no dropout, no GQA, no returned "
                    "log-sum-exp) attention only; use parallel.ring: 1 (Ulysses only) for this model"
                )
            return _masked_context_parallel_attention(query, key, value, attn_mask, scale, cp)
        forward_op, backward_op = _ring_ops(query)
        return ad._templated_context_parallel_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_lse,
            forward_op=forward_op,
            backward_op=backward_op,
            _parallel_config=_parallel_config,
        )

    native_or_ring._spindle_ring = True  # type: ignore[attr-defined]
    registry._backends[ad.AttentionBackendName.NATIVE] = native_or_ring
