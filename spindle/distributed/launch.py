"""`--nproc N`: re-run the same `spindle` command under torchrun (PyTorch's own launcher).

`spindle train cfg.yaml --nproc 4` becomes
`python -m torch.distributed.run --standalone --nproc_per_node 4 -m spindle train cfg.yaml`.
Under torchrun (RANK set) nothing is re-launched, so plain `torchrun -m spindle ...` and
multi-node rendezvous (`torchrun --nnodes ... --rdzv-endpoint ...`) work the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def under_launcher() -> bool:
    """True inside a torchrun (or any env:// launcher) worker."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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

    Returns the launcher's exit code, or None when the caller should just go on in this process
    (nproc == 1, or already a launched worker). `argv` is the command line after the program name
    (`sys.argv[1:]`).
    """
    if not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    if nproc == 1 or under_launcher():
        return None
    cmd = torchrun_command(nproc, argv, module)
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C reaches torchrun too (same process group); it stops its workers. Wait for that,
        # and make sure it does not outlive us.
        try:
            return proc.wait(timeout=30) or 130
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            return 130
