"""Run a function on N real processes (spawned, gloo on CPU) for distributed tests and benchmarks."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int, backend: str, args: tuple
) -> None:
    if backend == "gloo":
        # CPU/gloo: hide GPUs before torch touches CUDA (the mesh's device type follows CUDA).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Nobody may tear the group down while a peer is still inside a collective (gloo aborts).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1, backend: str = "gloo") -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes (CPU + gloo by default;
    backend="nccl": one GPU per rank).

    `fn` must be importable by name (a module-level function). Raises if any process fails.
    """
    import torch.multiprocessing as mp

    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads, backend, args),
        nprocs=world_size,
        join=True,
        start_method="spawn",
    )
