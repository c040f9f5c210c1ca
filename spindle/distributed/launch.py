"""`--nproc N`: re-run the same `spindle` command under torchrun (PyTorch's own launcher).

`spindle train cfg.yaml --nproc 4` becomes
`python -m torch.distributed.run --standalone --nproc_per_node 4 -m spindle train cfg.yaml`.
Under torchrun (RANK set) nothing is re-launched, so plain `torchrun -m spindle ...` and
multi-node rendezvous (`torchrun --nnodes ... --rdzv-endpoint ...`) work the same way.

Stopping: the `spindle` process is the one a scheduler or a user signals (SLURM, Kubernetes, Ctrl-C).
SIGTERM, SIGINT and SIGHUP are forwarded to torchrun, which stops its workers; whatever of the job
still runs `STOP_GRACE_S` later is killed. A checkpoint in flight is abandoned as `step-N.tmp`,
which is never resumed, so the last complete one stays the newest. Workers also stop when the
launcher dies without forwarding anything (SIGKILL, OOM killer): torchrun gets SIGTERM through
PR_SET_PDEATHSIG, and each worker watches the launcher's PID (`SPINDLE_LAUNCHER_PID`), because torchrun
starts every worker in a session of its own, out of reach of the launcher's process group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

LAUNCHER_PID_ENV = "SPINDLE_LAUNCHER_PID"
# After a forwarded signal: how long the job has to stop (torchrun stops its workers, a worker mid-save
# is abandoned) before every process of it left is killed.
STOP_GRACE_S = 10.0
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_WATCH_POLL_S = 1.0


def under_launcher() -> bool:
    """True inside a torchrun (or any env:// launcher) worker."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def end_worker(code: int = 0) -> None:
    """End a launched worker now, after its work and its process group's teardown: output flushed and
    logging shut down, then `os._exit`, skipping the interpreter's own teardown. That teardown destroys
    what c10d left to the garbage collector (sub-groups a DeviceMesh still references, gloo's threads);
    a joinable thread met there aborts the process ("terminate called without an active exception",
    exit -6), which torchrun reports as the job failing after it finished (seen 1 in ~300 2-rank runs)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said on it
            pass
    os._exit(code)


def launcher_world_size() -> int | None:
    """WORLD_SIZE of a launched worker; None outside a launcher."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else None


def strip_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the workers must not re-launch)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def torchrun_command(nproc: int, argv: list[str], module: str = "spindle") -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        module,
        *strip_nproc(argv),
    ]


def maybe_relaunch(nproc: int, argv: list[str], *, module: str = "spindle") -> int | None:
    """Re-exec `python -m <module> <argv without --nproc>` on `nproc` local processes via torchrun.

    Returns the launcher's exit code (128 + the signal when a forwarded signal stopped the job), or
    None when the caller should just go on in this process (nproc == 1, or already a launched
    worker, which then starts watching its launcher). `argv` is the command line after the program
    name (`sys.argv[1:]`).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    if under_launcher():
        watch_launcher()
        return None
    if nproc == 1:
        return None
    return run_job(torchrun_command(nproc, argv, module))


# ---------------------------------------------------------------- processes (Linux /proc; elsewhere degraded)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; None when the process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name (field 2) may hold spaces and ')'
    return None if fields[0] in ("Z", "X") else fields


def process_start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), None when it is gone: a PID plus its start
    time names one process, even after the PID is reused. Without /proc: 0 while the PID exists."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every live process below `pid`."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    started: dict[int, int] = {}
    for child in entries:
        if (fields := _stat_fields(child)) is not None:
            children.setdefault(int(fields[1]), []).append(child)
            started[child] = int(fields[19])
    found: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = started[child]
        todo += children.get(child, [])
    return found


def set_parent_death_signal(sig: int) -> None:
    """Linux: this process gets `sig` when its parent exits (PR_SET_PDEATHSIG); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def _torchrun_preexec() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # blocked in the launcher while it forks
    set_parent_death_signal(signal.SIGTERM)  # the launcher killed outright: torchrun stops its workers


def run_job(cmd: list[str], grace_s: float = STOP_GRACE_S) -> int:
    """Run the torchrun command `cmd` as this launcher's job (see the module doc); -> its exit code."""
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid())}
    received: list[int] = []
    forwarded = [0]
    started: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: object) -> None:  # Python runs it in the main thread, between bytecodes
        received.append(signum)
        for proc in started:
            forwarded[0] += 1
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    handlers = threading.current_thread() is threading.main_thread()  # signal.signal works only there
    # A signal this process ignores stays ignored (`nohup` ignores SIGHUP, a background job SIGINT).
    wanted = [sig for sig in _FORWARDED if handlers and signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, forward) for sig in wanted}
    try:
        # Held back while torchrun starts: one arriving meanwhile is delivered, and forwarded, after.
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        try:
            # Its own session: a terminal's Ctrl-C reaches only the launcher, which forwards it once.
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_torchrun_preexec)
            started.append(proc)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        if len(received) > forwarded[0]:  # caught (by another thread) before torchrun could get it
            proc.send_signal(received[-1])
        return _supervise(proc, received, grace_s)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _supervise(proc: subprocess.Popen[bytes], received: list[int], grace_s: float) -> int:
    # The job's processes, listed when a signal arrives (torchrun still waits for its workers then):
    # workers in sessions of their own outlive a killed torchrun, so they are tracked by PID.
    job: dict[int, int] = {}
    deadline: float | None = None
    seen_signals = 0
    while True:
        try:
            code: int | None = proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            code = None
        now = time.monotonic()
        if len(received) > seen_signals:
            job.update(descendants(proc.pid))
            name = signal.Signals(received[-1]).name
            if deadline is None:
                deadline = now + grace_s
                print(f"spindle: {name} received; stopping the job ({len(job)} processes)", file=sys.stderr)
            else:  # signalled again: no more patience
                deadline = now
            seen_signals = len(received)
        if code is not None and deadline is None:
            return code  # torchrun ended on its own, after waiting for its workers
        left = {pid: t for pid, t in job.items() if process_start_time(pid) == t}
        if code is not None and not left:
            return 128 + received[0]
        if deadline is not None and now >= deadline:
            _kill(proc, left, grace_s)
            return 128 + received[0]


def _kill(proc: subprocess.Popen[bytes], left: dict[int, int], grace_s: float) -> None:
    print(f"spindle: the job did not stop within {grace_s:.0f} s; killing {len(left) + 1} processes", file=sys.stderr)
    doomed = {**descendants(proc.pid), **left}
    for pid, started in doomed.items():
        if process_start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.kill()
    proc.wait()
    # SIGKILL takes effect asynchronously: return once the job is really gone (bounded all the same)
    deadline = time.monotonic() + 5.0
    while any(process_start_time(pid) == t for pid, t in doomed.items()) and time.monotonic() < deadline:
        time.sleep(0.02)


_watching = False


def watch_launcher() -> None:
    """In a worker of `spindle ... --nproc N`: exit when the launcher is gone, however it went
    (PR_SET_PDEATHSIG covers torchrun, this worker's parent; a thread polls the launcher's PID)."""
    global _watching
    value = os.environ.get(LAUNCHER_PID_ENV, "")
    if _watching or not value.isdigit():
        return
    _watching = True
    set_parent_death_signal(signal.SIGTERM)
    pid = int(value)
    started = process_start_time(pid)
    if started is None:  # the launcher waits for us, so it runs: we just cannot see it (no /proc access)
        return

    def watch() -> None:
        while process_start_time(pid) == started:
            time.sleep(_WATCH_POLL_S)
        print(f"spindle: the launcher (pid {pid}) is gone; stopping this worker (pid {os.getpid()})", file=sys.stderr)
        os._exit(1)  # no cleanup: the peers are going too, and a checkpoint in flight stays a .tmp

    threading.Thread(target=watch, name="spindle-launcher-watch", daemon=True).start()
