"""Keep freed host memory in the process instead of handing it back to the OS (glibc `mallopt`).

PyTorch's CPU tensors come from `malloc`. glibc serves a large block (over its mmap threshold,
128 KiB at start) with a fresh `mmap` and unmaps it on free, and it trims the top of the heap back
to the OS as soon as more than the trim threshold is free. Every new buffer then starts on pages
the kernel has to fault in and zero, once per 4 KiB. A denoising step or a training step allocates
and frees the same activation-sized buffers over and over, so on CPU the step pays those page
faults again and again. Measured on the 2-core CPU this project runs on (`bench/generate.py --preset
flux-cpu`): stock diffusers takes about 180,000 minor faults per request; Spindle with the settings
below 0 after the first, and in `exact` mode (the same arithmetic as diffusers) that alone is 1.29x.
The numbers are bit-identical: only where the bytes live changes.

The cost is the usual caching-allocator trade-off: the process keeps its peak heap instead of
returning it (PyTorch's CUDA caching allocator does the same with device memory). Engines on CPU
turn this on by default; `keep_freed_memory=False` (Python) / `--no-keep-freed-memory` (CLI) leave
glibc's defaults alone.

Training is the opposite case: its RSS is what limits the model size on a host, and a training
step's buffers are of many sizes (FSDP2 all-gathers, activations, gradients), so a heap that never
returns memory fragments and grows. Measured (`bench/load_memory.py --preset wan-0.34b --lora 16
--world 2`, a 0.34B Wan, 1.30 GB in fp32): the largest rank's peak RSS in step 1 is 3.57 GB with the
memory kept, 2.09 GB with glibc's defaults (its dynamic mmap threshold, raised by the first freed
32 MiB block, keeps later ones in the heap), 1.43 GB with `bound_freed_memory` (the threshold fixed
at glibc's initial 128 KiB: every large buffer is mapped and returned on free, so RSS follows the
memory in use; 1.14 GB once the frozen bf16 weights stay bf16, spindle.train.precision.frozen_storage). Trainers on CPU use `bound_freed_memory` unless `train.keep_freed_memory: true`.
Other C libraries (musl, macOS) are left as they are.
"""

from __future__ import annotations

import ctypes
import platform

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: never trim the heap top
# glibc caps the mmap threshold (HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit builds that enforce it); blocks
# above it stay mmap'ed, which is fine: they are rare, and big enough that a fault per page is cheap
_MMAP_THRESHOLDS = (2**30, 32 * 2**20)

_INITIAL_MMAP_THRESHOLD = 128 * 1024  # glibc's starting value; setting it explicitly stops the dynamic raise

_applied: bool | None = None  # None: not asked yet in this process


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once; later calls are no-ops).
    -> whether the settings are in force."""
    global _applied
    if _applied:
        return True
    _applied = False
    if (libc := _glibc()) is None:
        return False
    # mallopt returns 1 on success; the first threshold glibc accepts wins
    if not any(libc.mallopt(_M_MMAP_THRESHOLD, value) == 1 for value in _MMAP_THRESHOLDS):
        return False
    _applied = libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    return _applied


def bound_freed_memory() -> bool:
    """Return freed host memory to the OS as soon as it is freed (blocks over 128 KiB are mapped and
    unmapped; the heap top is trimmed past 128 KiB free), undoing `keep_freed_memory` if it was on:
    the process's RSS follows the memory it uses. -> whether the settings are in force."""
    global _applied
    if (libc := _glibc()) is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _INITIAL_MMAP_THRESHOLD) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, _INITIAL_MMAP_THRESHOLD) == 1 and ok
    if ok:
        _applied = False
        libc.malloc_trim(0)  # what the heap already holds free goes back now, not at the next free
    return ok


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def is_kept() -> bool:
    """Whether `keep_freed_memory` has put its settings in force in this process."""
    return bool(_applied)
