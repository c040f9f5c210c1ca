"""Process group + DeviceMesh set-up. One process is the degenerate mesh, never a special case.

Mesh dims (outer to inner): dp_replicate (HSDP replicas), dp_shard (FSDP2), ring (ring attention),
sp (Ulysses). The sequence-parallel group is `ring x sp` ("cp", 2-D: diffusers' ring x Ulysses, USP);
Ulysses is innermost (its all-to-alls want the fastest links). FSDP shards parameters over the
flattened `dp_shard x ring x sp` ("fsdp"); data is split over `dp_replicate x dp_shard` ("dp") only,
so all ranks of a sequence-parallel group see the same sample.
Expert parallelism (`ep`, MoE models) divides the FSDP ranks `dp_shard x ring x sp`: its meshes are
views of "fsdp" (see `build_mesh`), so the dense layout does not change with ep.

Every sub-mesh is built here, once, in `build_mesh` (collective: every rank calls it): FSDP2,
HSDP, sequence parallel and expert parallel code take them from the `Mesh`, never build their own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from spindle.distributed.launch import under_launcher


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of the world size
    sp: int = 1  # Ulysses degree (heads are split over it)
    ring: int = 1  # ring-attention degree (the sequence is split over ring x sp)
    ep: int = 1  # expert parallel: a divisor of dp_shard x ring x sp (spindle.distributed.expert_parallel)

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in dp_shard=-1 and check the product equals the world size."""
        for name in ("dp_replicate", "sp", "ring"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        fixed = self.dp_replicate * self.cp_size
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world_size % fixed:
                raise ValueError(
                    f"world size {world_size} is not divisible by parallel.dp_replicate x parallel.ring x "
                    f"parallel.sp = {fixed}"
                )
            dp_shard = world_size // fixed
        elif dp_shard < 1:
            raise ValueError(f"parallel.dp_shard must be >= 1 or -1 (the rest of the world), got {dp_shard}")
        if self.dp_replicate * dp_shard * self.cp_size != world_size:
            raise ValueError(
                f"parallel dims dp_replicate={self.dp_replicate} x dp_shard={dp_shard} x ring={self.ring} x "
                f"sp={self.sp} = {self.dp_replicate * dp_shard * self.cp_size}, but the world size is {world_size}; "
                f"make the product equal the number of processes (or set dp_shard: -1)"
            )
        if self.ep > 1 and dp_shard * self.cp_size < self.ep:
            # the usual cause: an EP config (configs/qwen3_moe_tiny.yaml) started without its launcher flag
            raise ValueError(
                f"parallel.ep={self.ep} splits the experts over {self.ep} processes, but this job has {world_size}; "
                f"run with --nproc {self.ep * self.dp_replicate} (or a multiple), or set parallel.ep=1"
            )
        if self.ep < 1 or (dp_shard * self.cp_size) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must be >= 1 and divide parallel.dp_shard x parallel.sp = "
                f"{dp_shard} x {self.sp}: expert-parallel ranks are the FSDP ranks (data-parallel and "
                "sequence-parallel) that split the experts between them"
            )
        return ParallelDims(self.dp_replicate, dp_shard, self.sp, self.ring, self.ep)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def cp_size(self) -> int:
        """Ranks one sequence is split over (ring x Ulysses)."""
        return self.ring * self.sp

    @property
    def fsdp_size(self) -> int:
        return self.dp_shard * self.cp_size


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed() -> tuple[int, int]:
    """Initialise the default process group once (torchrun env, or a 1-process group); -> (rank, world)."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if under_launcher():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    else:
        # No launcher: a 1-process group on an in-memory store (no ports, no env vars needed).
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


@dataclass
class Mesh:
    """The world mesh plus the named sub-meshes the trainer and engine use."""

    dims: ParallelDims
    world: DeviceMesh
    dp: DeviceMesh  # data split: dp_replicate x dp_shard (flattened)
    fsdp: DeviceMesh  # parameter sharding: dp_shard x ring x sp (flattened)
    sp: DeviceMesh  # Ulysses sequence parallel group
    cp: DeviceMesh  # the whole sequence-parallel group, 2-D (ring, sp)
    # What FSDP2 shards over: `fsdp` (1-D), or 2-D (dp_replicate, fsdp) for HSDP.
    shard: DeviceMesh
    # Expert parallelism (None when ep == 1): this rank's EP group; the mesh the experts' FSDP2 units
    # shard over (ranks holding the same experts; 2-D (dp_replicate, efsdp) under HSDP); and a 1-rank
    # mesh (the "ranks sharing one batch" group transformers' EP takes: no TP here).
    ep: DeviceMesh | None = None
    efsdp: DeviceMesh | None = None
    ep_one: DeviceMesh | None = None

    @property
    def dp_rank(self) -> int:
        return self.dp.get_local_rank()

    @property
    def sp_rank(self) -> int:
        return self.sp.get_local_rank()


def build_mesh(dims: ParallelDims) -> Mesh:
    """Create the DeviceMesh for `dims` over the (already initialised) default process group."""
    _, world_size = init_distributed()
    dims = dims.resolve(world_size)
    world = init_device_mesh(
        device_type(),
        (dims.dp_replicate, dims.dp_shard, dims.ring, dims.sp),
        mesh_dim_names=("dp_replicate", "dp_shard", "ring", "sp"),
    )
    # Keep the flattened meshes ourselves: slicing flattened dims off the root mesh is deprecated.
    dp = world[("dp_replicate", "dp_shard")]._flatten("dp")
    fsdp = world[("dp_shard", "ring", "sp")]._flatten("fsdp")
    shard = fsdp
    if dims.dp_replicate > 1:
        # HSDP. Slicing the flattened "fsdp" dim off the root mesh is deprecated (torch 2.11); an
        # unflattened view of the flattened world keeps one root mesh and the same rank layout
        # (world is row-major over (dp_replicate, dp_shard, ring, sp)).
        flat = world._flatten("world_flat")
        shard = flat._unflatten(0, (dims.dp_replicate, dims.fsdp_size), ("dp_replicate", "fsdp"))
    mesh = Mesh(dims, world, dp=dp, fsdp=fsdp, sp=world["sp"], cp=world[("ring", "sp")], shard=shard)
    if dims.ep > 1:
        # EP borrows from the flattened FSDP ranks, inner (as torchtitan does): with SP the EP group
        # first spans the SP ranks of the same rows (the all-to-all stays on the fastest links), then
        # data-parallel ranks (spindle.distributed.expert_parallel).
        split = fsdp._unflatten(0, (dims.fsdp_size // dims.ep, dims.ep, 1), ("efsdp", "ep", "one"))
        efsdp = split["efsdp"]
        if dims.dp_replicate > 1:  # HSDP: experts replicated over dp_replicate, sharded over efsdp
            efsdp = DeviceMesh._concatenate([world["dp_replicate"], efsdp])
        mesh.ep, mesh.efsdp, mesh.ep_one = split["ep"], efsdp, split["one"]
    return mesh


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def is_main_process() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
