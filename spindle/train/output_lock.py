"""One run per output folder: `output_dir/spindle.lock` names the holder (host, PID, start time).

Two runs writing into one folder interleave checkpoints and metrics; a second run (`resume=auto`
after a launcher died, a double-submitted job) is refused while the holder lives. A lock left by a
process that is gone (killed, the machine rebooted) is taken over with a warning. The lock is a file
created with O_EXCL, not an flock, so it also works on the network file systems that output folders
often live on. A holder on another host cannot be checked from here: that is refused, and the message
says which file to delete when the run there is known to be over.

`spindle train --nproc N` takes the lock in the launcher (the process a scheduler signals); its
workers see their launcher's PID in the lock and go on (`SPINDLE_LAUNCHER_PID`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from spindle.distributed.launch import LAUNCHER_PID_ENV, process_start_time

LOCK_FILE = "spindle.lock"
log = logging.getLogger("spindle.train")


class OutputLockedError(ValueError):
    """Another live run holds the output folder."""


def _holder(path: Path) -> dict[str, Any] | None:
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        return {}  # a lock torn by a crash mid-write: nobody can hold it
    return info if isinstance(info, dict) else {}


def _alive(info: dict[str, Any]) -> bool:
    """The recorded holder still runs: same PID and same start time (a reused PID is another process)."""
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    started = process_start_time(pid)
    return started is not None and started == info.get("start_time", started)


class OutputLock:
    """`with OutputLock(output_dir):` holds the folder for the duration (see the module doc)."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": process_start_time(os.getpid())}
        for _ in range(3):  # a takeover races another takeover at most a couple of times
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._check_holder(me)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps({**me, "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
            self.held = True
            return
        raise OutputLockedError(f"could not take {self.path}: other runs keep taking it; is a job restarting there?")

    def _check_holder(self, me: dict[str, Any]) -> None:
        """Refuse a live holder; remove a stale lock (the caller then retries)."""
        info = _holder(self.path)
        if info is None:
            return  # released meanwhile
        ours = info.get("host") == me["host"]
        if ours and info.get("pid") == me["pid"]:  # this process: a Trainer built again in one Python session
            self.path.unlink(missing_ok=True)
            return
        if not ours and info.get("host"):
            raise OutputLockedError(
                f"train.output_dir {self.path.parent} is in use by a run on host {info['host']} (pid {info.get('pid')}, "
                f"since {info.get('since')}); wait for it or choose another train.output_dir. If that run is over, "
                f"delete {self.path}"
            )
        if info and _alive(info):
            raise OutputLockedError(
                f"train.output_dir {self.path.parent} is in use by a live run (pid {info['pid']} on {info['host']}, "
                f"since {info.get('since')}); wait for it, stop it, or choose another train.output_dir"
            )
        log.warning(
            "taking over %s: the run that held it (pid %s on %s, since %s) is gone",
            self.path,
            info.get("pid"),
            info.get("host"),
            info.get("since"),
        )
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if self.held:
            info = _holder(self.path)
            if info and info.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _launcher_pid() -> int | None:
    value = os.environ.get(LAUNCHER_PID_ENV)
    return int(value) if value and value.isdigit() else None


def held_by_our_launcher(output_dir: str | Path) -> bool:
    """True in a `--nproc N` worker whose launcher holds the folder's lock (the workers then take none)."""
    info = _holder(Path(output_dir) / LOCK_FILE)
    launcher = _launcher_pid()
    return info is not None and launcher is not None and info.get("pid") == launcher
