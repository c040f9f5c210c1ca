"""Which attention a DiT's transformer runs (training `model.attention_backend`, inference `--attention-backend`):
diffusers' attention dispatcher backend, set on the model with diffusers' own `set_attention_backend`.

`native` (the default) is torch's SDPA as diffusers calls it and sets nothing, so outputs stay equal to the stock
pipeline. Any other name of diffusers' `AttentionBackendName` (flash, flash_varlen, _flash_3, sage, flex,
xformers, _native_cudnn, _native_flash, ...) is checked before any model loads: a backend whose package is not
installed is refused with diffusers' own reason, a CUDA kernel on a CPU run with the backends a CPU has, the
`*_hub` backends (they download kernels at run time: not pinned, and no network here) always, and under sequence
parallelism a backend that diffusers' context parallelism does not support (ring attention: `native` only, the
one Spindle's CPU ring ops wrap: spindle.distributed.context_parallel).
"""

from __future__ import annotations

from typing import Any

DEFAULT = "native"
# what torch's CPU SDPA kernels can run (the rest are CUDA kernels)
CPU_BACKENDS = ("native", "_native_math", "_native_flash")


def backend_names() -> list[str]:
    from diffusers.models.attention_dispatch import AttentionBackendName

    return sorted(x.value for x in AttentionBackendName)


def check_dit_backend(name: str, device_type: str, ulysses: int = 1, ring: int = 1) -> None:
    """Raise ValueError naming why `name` cannot run here (module doc); nothing for one that can."""
    if name == DEFAULT:
        return
    names = backend_names()
    if name not in names:
        raise ValueError(f"attention backend {name!r} is not one of diffusers': {', '.join(names)}")
    if name.endswith("_hub"):
        raise ValueError(
            f"attention backend {name!r} downloads its kernel from the Hugging Face Hub at run time; install the "
            "kernel's package and use the local backend (e.g. flash instead of flash_hub)"
        )
    if device_type != "cuda" and name not in CPU_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} runs CUDA kernels; on {device_type} use one of {', '.join(CPU_BACKENDS)}"
        )
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _AttentionBackendRegistry,
        _check_attention_backend_requirements,
    )

    backend = AttentionBackendName(name)
    try:
        _check_attention_backend_requirements(backend)
    except RuntimeError as e:
        raise ValueError(f"attention backend {name!r}: {e}") from None
    if ring > 1:
        raise ValueError(
            f"attention backend {name!r} with ring attention: Spindle's ring runs diffusers' native backend; "
            "set it to native or the ring degree to 1"
        )
    if ulysses > 1 and not _AttentionBackendRegistry._is_context_parallel_available(backend):
        supported = sorted(b.value for b in _AttentionBackendRegistry._supports_context_parallel)
        raise ValueError(
            f"attention backend {name!r} does not support sequence parallelism in diffusers; use one of {supported}"
        )


def apply_dit_backend(model: Any, name: str) -> None:
    """Set `name` on a diffusers model's attention processors (`native`: nothing is set). diffusers' method also
    makes it the process-wide active backend, which every other model's processors without their own would then
    run; that is put back, so the choice stays with this model."""
    if name == DEFAULT:
        return
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    try:
        model.set_attention_backend(name)
    finally:
        _AttentionBackendRegistry.set_active_backend(before)
