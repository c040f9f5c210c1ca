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
# then starts in well under a second instead of paying ~6 s of CPU to import torch, transformers and diffusers,
# and ~1.5 s more for what a command imports on the way (`spindle.testing.preload`).
_PRELOAD = ["torch", "torch.distributed", "transformers", "diffusers", "spindle.api", "spindle.testing.preload"]


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
    be marked `slow`, so that `-m "not slow"` stays the quick loop (CI runs both)."""
    if os.environ.get("SPINDLE_TEST_SLOW") == "0":
        test = os.environ.get("PYTEST_CURRENT_TEST", "this test").split(" ")[0]
        raise AssertionError(f"{test} starts several processes: mark it @pytest.mark.slow (CONTRIBUTING.md)")


class SpindleProcess:
    """`spindle ARGS` in a process of its own, as a user's shell runs it, minus the fresh interpreter: a child of
    the test session's preloaded forkserver (see `spawn`) that calls `spindle.cli.main(ARGS)` (the function the
    console script and `python -m spindle` call) and exits with its code, after the interpreter's exit handlers
    (`atexit`: logging's flush) as a normal exit runs them. Its own pid, environment, signal dispositions,
    stdout/stderr (files: `log` + ".out" / ".err") and exit status (-N when killed by signal N, like Popen's
    returncode); what it saves is ~5 s of CPU per command to import torch, transformers and diffusers.
    `python -m spindle` itself (interpreter start, `__main__`) has its own tests: `fresh=True` in `run_spindle`."""

    def __init__(self, *args: object, log: str | os.PathLike, env: dict[str, str] | None = None, threads: int = 0):
        import multiprocessing

        self.argv = [str(a) for a in args]
        self.out, self.err = f"{log}.out", f"{log}.err"
        multiprocessing.set_forkserver_preload(_PRELOAD)
        self._proc = multiprocessing.get_context("forkserver").Process(
            target=_cli_process, args=(self.argv, {**os.environ, **(env or {})}, self.out, self.err, threads)
        )
        self._proc.start()
        assert self._proc.pid is not None
        self.pid: int = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; raises subprocess.TimeoutExpired (the process left running) after `timeout` s."""
        import subprocess

        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(["spindle", *self.argv], timeout or 0)
        return self._proc.exitcode

    def output(self) -> tuple[str, str]:
        return _tail(self.out, None), _tail(self.err, None)


def _cli_process(argv: list[str], environ: dict[str, str], out: str, err: str, threads: int) -> None:
    """The body of a `SpindleProcess`: the caller's environment, output to files, `spindle.cli.main(argv)`, exit."""
    import atexit
    import sys

    os.environ.clear()
    os.environ.update(environ)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    if threads:  # what OMP_NUM_THREADS does for a fresh interpreter (torch is imported already here)
        import torch

        torch.set_num_threads(threads)
    sys.argv = ["spindle", *argv]
    code: int = 1
    try:
        kill_at = os.environ.get("SPINDLE_TEST_KILL_AT")
        if kill_at:
            _kill_at_step(int(kill_at))
        from spindle.cli import main

        code = main(argv)
    except SystemExit as e:  # argparse's usage errors, commands that exit themselves
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): the interpreter prints it and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    finally:  # an uncaught exception: multiprocessing prints its traceback and exits 1, as the interpreter does
        atexit._run_exitfuncs()  # a forked child ends by os._exit, which runs none of them
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code or 0)


def _kill_at_step(step: int) -> None:
    """`spindle train` that SIGKILLs itself as step `step` begins: no handler, no cleanup, as a node failure or an
    OOM killer leaves a run (the kill -9 resume tests; SPINDLE_TEST_KILL_AT in a `SpindleProcess`'s env)."""
    import signal

    from spindle.train.trainer import Trainer

    original = Trainer.train_step

    def train_step(self: Any) -> Any:
        if self.step == step - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self)

    Trainer.train_step = train_step  # type: ignore[method-assign]


def run_spindle(
    *args: object,
    timeout: float = 600,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> Any:
    """`spindle ARGS...` in a process of its own (a `SpindleProcess`, or with `fresh` a new `python -m spindle`
    interpreter: the tests of the interpreter's entry itself); -> CompletedProcess (stdout, stderr, returncode;
    -N when killed by signal N). `threads`: OMP_NUM_THREADS for it (1 for `--nproc` runs, whose workers share
    the cores); `env`: variables added to this process's environment."""
    import subprocess
    import sys
    import tempfile

    argv = [str(a) for a in args]
    if "--nproc" in argv and argv.index("--nproc") + 1 < len(argv) and argv[argv.index("--nproc") + 1] != "1":
        check_marked_slow()
    extra = {**(env or {}), **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    if fresh:
        return subprocess.run(
            [sys.executable, "-m", "spindle", *argv],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **extra},
        )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="spindle-cli-") as logs:
        proc = SpindleProcess(*argv, log=Path(logs) / "cli", env=extra, threads=threads or 0)
        try:
            code = proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out, err = proc.output()
    return subprocess.CompletedProcess(["spindle", *argv], code, stdout=out, stderr=err)


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
