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


def run_spindle(*args: object, timeout: float = 600, threads: int | None = None) -> Any:
    """`python -m spindle ARGS...` in a subprocess (this tree's code via PYTHONPATH); -> CompletedProcess.
    `threads`: OMP_NUM_THREADS for it (1 for `--nproc` runs, whose workers share the cores)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    return subprocess.run(
        [sys.executable, "-m", "spindle", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def dotted_overrides(base: dict[str, Any], **values: Any) -> list[str]:
    """`base` ({"train.lr": 1e-3, ...}) updated with `values` (`train__lr=...` style keys) -> the dotted
    `key=value` overrides `spindle train` and `load_job_config` take."""
    merged = {**base, **{k.replace("__", "."): v for k, v in values.items()}}
    return [f"{k}={v}" for k, v in merged.items()]


def torchrun(nproc: int, *args: str, timeout: float = 600):
    """`python -m torch.distributed.run --standalone --nproc-per-node=NPROC ARGS...` (one thread a
    worker: the ranks share the machine's cores); -> the CompletedProcess, output captured."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


# A torchrun worker: load_generator(root, **options).generate(**kw) on every rank,
# each rank's frames saved; with `unseeded`, a second 1-step request without a seed too.
_GENERATE_WORKER = """
import json, sys
import numpy as np
import torch.distributed as dist
from spindle.api import load_generator
root, out, options, kw, unseeded = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5]
gen = load_generator(root, **options)
np.save(f"{out}.rank{dist.get_rank()}.npy", gen.generate(**kw).frames)
if unseeded == "1":
    drawn = gen.generate(**{**kw, "seed": None, "num_inference_steps": 1})
    np.save(f"{out}.drawn{dist.get_rank()}.npy", drawn.frames)
dist.destroy_process_group()
"""


def generate_on_ranks(
    root: str | os.PathLike, options: dict[str, Any], kw: dict[str, Any], workdir: str | os.PathLike, *,
    nproc: int = 2, unseeded: bool = False,
) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """`generate(**kw)` with the engine `options` (sp, ring, cfg_parallel ...) on `nproc` real torchrun
    processes; -> (each rank's frames, each rank's frames of an unseeded 1-step request, [] unless
    `unseeded`). Raises AssertionError with the workers' stderr when they fail."""
    import json
    from pathlib import Path

    import numpy as np

    workdir = Path(workdir)
    script, out = workdir / "generate_worker.py", workdir / "frames"
    script.write_text(_GENERATE_WORKER)
    args = [str(script), str(root), str(out), json.dumps(options), json.dumps(kw), "1" if unseeded else "0"]
    r = torchrun(nproc, *args)
    assert r.returncode == 0, r.stderr[-4000:]
    frames = [np.load(f"{out}.rank{rank}.npy") for rank in range(nproc)]
    drawn = [np.load(f"{out}.drawn{rank}.npy") for rank in range(nproc)] if unseeded else []
    return frames, drawn
