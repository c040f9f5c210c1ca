"""Staged inference engine: BeforeDenoising (per family) -> Denoising -> Decoding (shared).

Public API: `DiffusionGenerator`, `GenerationResult`, `SamplingParams`, `RequestError`, `Cancelled`.
Heavy modules import lazily, so `import spindle.infer` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spindle.infer.request import Cancelled, Req, RequestError, SamplingParams

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on first use
    from spindle.infer.generator import DiffusionGenerator, GenerationResult, psnr
    from spindle.infer.pipeline import EngineOptions, InferencePipeline
    from spindle.infer.stages import BeforeDenoisingStage, DecodingStage, DenoisingStage, InferenceSpec, Stage

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

# Literal strings (not `*_LAZY`): static tools read `__all__` without running the module.
# tests/test_infer_api.py checks that it lists exactly the eager names plus `_LAZY`.
__all__ = [
    "BeforeDenoisingStage",
    "Cancelled",
    "DecodingStage",
    "DenoisingStage",
    "DiffusionGenerator",
    "EngineOptions",
    "GenerationResult",
    "InferencePipeline",
    "InferenceSpec",
    "Req",
    "RequestError",
    "SamplingParams",
    "Stage",
    "psnr",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spindle.infer' has no attribute {name!r}")
