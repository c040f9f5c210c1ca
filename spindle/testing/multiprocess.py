"""Run a function on N real processes (spawned, gloo on CPU) for distributed tests and benchmarks."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a spawned rank imports anyway, imported once by the forkserver that forks the ranks (see `spawn`): a rank
# then starts in well under a second instead of paying ~6 s of CPU to import torch, transformers and diffusers.
_PRELOAD = ["torch", "torch.distributed", "transformers", "diffusers", "spindle.train.trainer", "spindle.api"]


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    threads: int,
    backend: str,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # A forkserver's child has the server's environment (from its start); the caller's is the one that counts.
    os.environ.clear()
    os.environ.update(environ)
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
    import multiprocessing

    import torch.multiprocessing as mp

    if world_size > 1:
        check_marked_slow()
    # forkserver, not fork: each rank is a fresh fork of a server that only imported modules (no threads, no
    # state of the calling process); sys.path and the working directory travel with each start, the
    # environment through `_entry`. The preload applies when the server starts (once per calling process).
    multiprocessing.set_forkserver_preload(_PRELOAD)
    mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), threads, backend, args, dict(os.environ)),
        nprocs=world_size,
        join=True,
        start_method="forkserver",
    )


def _cli_rank(rank: int, world_size: int, argv: list[str], logs: str) -> None:
    """One rank of `spindle ARGV`: what a torchrun worker runs (`spindle.cli.main` under a launcher's
    environment), its output in LOGS.rankN.out / .err."""
    import sys

    with open(f"{logs}.rank{rank}.out", "w") as out, open(f"{logs}.rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    from spindle.cli import main

    code = main(argv)  # a launched `spindle train` ends its process itself (launch.end_worker)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise SystemExit(code)


def spindle_on_ranks(nproc: int, *args: object, logs: str | os.PathLike) -> Any:
    """`spindle ARGS --nproc NPROC` as the job's workers run it: NPROC real processes (gloo), each
    `spindle.cli.main(ARGS)` with the environment torchrun gives its workers, forked from the test
    session's preloaded forkserver (`spawn`) instead of started cold by torchrun (~6 s of CPU a rank
    to import torch, transformers and diffusers). The launcher itself (`--nproc` re-running the command
    under torchrun, signals, the output lock) has its own tests, which call the real command.
    -> a CompletedProcess with rank 0's output; raises AssertionError with every rank's stderr on failure."""
    import subprocess

    from torch.multiprocessing.spawn import ProcessException

    argv = [str(a) for a in args]
    try:
        spawn(_cli_rank, nproc, argv, str(logs))
    except ProcessException as e:  # a rank raised or exited non-zero: its own words are in its log
        errs = "".join(f"--- rank {r} stderr ---\n{_tail(f'{logs}.rank{r}.err')}" for r in range(nproc))
        raise AssertionError(f"spindle {' '.join(argv)} on {nproc} ranks failed: {e}\n{errs}") from None
    return subprocess.CompletedProcess(
        ["spindle", *argv], 0, stdout=_tail(f"{logs}.rank0.out", None), stderr=_tail(f"{logs}.rank0.err", None)
    )


def _tail(path: str, chars: int | None = 4000) -> str:
    try:
        text = Path(path).read_text(errors="replace")  # closed at once; a rank's stray bytes never hide its log
    except OSError:
        return ""
    return text if chars is None else text[-chars:]


def check_marked_slow() -> None:
    """Under pytest (tests/conftest.py sets SPINDLE_TEST_SLOW for each test): a test that starts several ranks must
    be marked `slow`, so that `-m "not slow"` stays the quick loop and pytest-xdist runs such tests one at a time
    (two at once would put four ranks on CI's two cores)."""
    if os.environ.get("SPINDLE_TEST_SLOW") == "0":
        test = os.environ.get("PYTEST_CURRENT_TEST", "this test").split(" ")[0]
        raise AssertionError(f"{test} starts several processes: mark it @pytest.mark.slow (CONTRIBUTING.md)")


def run_spindle(*args: object, timeout: float = 600, threads: int | None = None) -> Any:
    """`python -m spindle ARGS...` in a subprocess (this tree's code via PYTHONPATH); -> CompletedProcess.
    `threads`: OMP_NUM_THREADS for it (1 for `--nproc` runs, whose workers share the cores)."""
    import subprocess
    import sys

    argv = [str(a) for a in args]
    if "--nproc" in argv and argv.index("--nproc") + 1 < len(argv) and argv[argv.index("--nproc") + 1] != "1":
        check_marked_slow()

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    return subprocess.run(
        [sys.executable, "-m", "spindle", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def dotted_overrides(base: dict[str, Any], **values: Any) -> list[str]:
    """`base` ({"train.lr": 1e-3, ...}) updated with `values` (`train__lr=...` style keys) -> the dotted
    `key=value` overrides `spindle train` and `load_job_config` take."""
    merged = {**base, **{k.replace("__", "."): v for k, v in values.items()}}
    return [f"{k}={v}" for k, v in merged.items()]


def _generate_rank(
    rank: int, world_size: int, root: str, out: str, options: dict[str, Any], kw: dict[str, Any], unseeded: bool
) -> None:
    """A rank of a multi-process generation: load_generator(root, **options).generate(**kw), the frames saved;
    with `unseeded`, a second 1-step request without a seed too."""
    import numpy as np

    from spindle.api import load_generator

    gen = load_generator(root, **options)
    np.save(f"{out}.rank{rank}.npy", gen.generate(**kw).frames)
    if unseeded:
        drawn = gen.generate(**{**kw, "seed": None, "num_inference_steps": 1})
        np.save(f"{out}.drawn{rank}.npy", drawn.frames)


def generate_on_ranks(
    root: str | os.PathLike, options: dict[str, Any], kw: dict[str, Any], workdir: str | os.PathLike, *,
    nproc: int = 2, unseeded: bool = False,
) -> tuple[list[Any], list[Any]]:  # fmt: skip
    """`generate(**kw)` with the engine `options` (sp, ring, cfg_parallel ...) on `nproc` real processes
    (gloo, forked warm: `spawn`) with a launcher's environment, as `spindle generate --nproc` workers run it;
    -> (each rank's frames, each rank's frames of an unseeded 1-step request, [] unless `unseeded`)."""
    from pathlib import Path

    import numpy as np

    out = Path(workdir) / "frames"
    spawn(_generate_rank, nproc, str(root), str(out), options, kw, unseeded)
    frames = [np.load(f"{out}.rank{rank}.npy") for rank in range(nproc)]
    drawn = [np.load(f"{out}.drawn{rank}.npy") for rank in range(nproc)] if unseeded else []
    return frames, drawn
