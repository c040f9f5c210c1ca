"""Staged inference engine: BeforeDenoising (per family) -> Denoising -> Decoding (shared).

Public API: `DiffusionGenerator`, `GenerationResult`, `SamplingParams`, `RequestError`, `Cancelled`.
Heavy modules import lazily, so `import spindle.infer` stays light.
"""

from __future__ import annotations

from typing import Any

from spindle.infer.request import Cancelled, Req, RequestError, SamplingParams

_LAZY = {
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

__all__ = ["Cancelled", "Req", "RequestError", "SamplingParams", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spindle.infer' has no attribute {name!r}")
