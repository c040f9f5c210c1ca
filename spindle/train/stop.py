"""Stopping a run on request without losing it: SIGTERM (a scheduler's preemption, `kill`, torchrun forwarding
the launcher's SIGTERM) or SIGINT (Ctrl-C) during training finishes the step in flight, saves a resumable
checkpoint of it, and ends the run with exit code 128 + the signal, so `checkpoint.resume=auto` continues exactly
where it stopped. The ranks agree on the step to stop after (one small all-reduce per step), so every rank saves
the same step's checkpoint. A second signal while the checkpoint is written is left to its default action (the
checkpoint is written to `.tmp` and renamed: the previous one stays good)."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Within the block, SIGTERM / SIGINT are recorded instead of ending the process (main thread only: that is
    where Python runs handlers; elsewhere nothing is installed and signals act as before)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))  # a second one acts at once

    def agreed(self, device: torch.device) -> int | None:
        """Collective after each step: the signal any rank received (the largest number), or None."""
        flag = torch.tensor([self.signum or 0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        return value or None
