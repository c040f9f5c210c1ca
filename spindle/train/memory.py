"""Peak memory per rank, reported at the start of a run (after the model is loaded and after step 1).

Host: the process's peak resident set size (`resource.getrusage(...).ru_maxrss`, a high-water mark
since the process started, so it includes the load). Device: `torch.cuda.max_memory_allocated` on CUDA.
Every rank measures its own; rank 0 logs them all in one line (a collective).
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("spindle.train")
GB = 1e9


@dataclass(frozen=True)
class PeakMemory:
    rank: int
    host_peak_gb: float
    device_peak_gb: float | None  # None: no accelerator


def host_peak_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def peak_memory(device: torch.device) -> PeakMemory:
    rank = dist.get_rank() if dist.is_initialized() else 0
    on_device = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    return PeakMemory(rank, host_peak_bytes() / GB, on_device)


def gather_peak_memory(device: torch.device) -> list[PeakMemory]:
    """Collective: every rank's `peak_memory`, in rank order (on every rank)."""
    mine = peak_memory(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, asdict(mine))
    return [PeakMemory(**e) for e in everyone if e is not None]


def format_peak_memory(when: str, peaks: list[PeakMemory]) -> str:
    def one(p: PeakMemory) -> str:
        device = f", device {p.device_peak_gb:.2f} GB" if p.device_peak_gb is not None else ""
        return f"rank {p.rank}: host {p.host_peak_gb:.2f} GB{device}"

    return f"peak memory {when}: " + "; ".join(one(p) for p in peaks)


def report_peak_memory(when: str, device: torch.device) -> list[PeakMemory]:
    """Collective: gather every rank's peak memory; rank 0 logs it. -> the peaks (every rank)."""
    peaks = gather_peak_memory(device)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(format_peak_memory(when, peaks))
    return peaks
