"""Staged inference engine: BeforeDenoising (per family) -> Denoising -> Decoding (shared).

Public API: `DiffusionGenerator`, `GenerationResult`, `SamplingParams`, `RequestError`, `Cancelled`.
Everything imports lazily, so `import spindle.infer` (and `spindle.infer.options`, which the CLI
reads to build its flags) stays free of torch.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Cancelled": "spindle.infer.request",
    "Req": "spindle.infer.request",
    "RequestError": "spindle.infer.request",
    "SamplingParams": "spindle.infer.request",
    "DiffusionGenerator": "spindle.infer.generator",
    "GenerationResult": "spindle.infer.generator",
    "psnr": "spindle.infer.generator",
    "EngineOptions": "spindle.infer.pipeline",
    "InferencePipeline": "spindle.infer.pipeline",
    "InferenceSpec": "spindle.infer.stages",
    "BeforeDenoisingStage": "spindle.infer.stages",
    "DenoisingStage": "spindle.infer.stages",
    "DecodingStage": "spindle.infer.stages",
    "Stage": "spindle.infer.stages",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spindle.infer' has no attribute {name!r}")
