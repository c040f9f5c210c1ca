"""Staged inference engine: BeforeDenoising (per family) -> Denoising -> Decoding (shared).

Public API: `DiffusionGenerator`, `GenerationResult`, `SamplingParams`, `RequestError`, `Cancelled`.
Load a checkpoint with `spindle.api.load_generator(path)` (it resolves the family). Everything imports
lazily, so `import spindle.infer` (and `spindle.infer.options`, which the server reads for its request
fields) stays free of torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on first use
    from spindle.contracts.request import Cancelled, Req, RequestError, SamplingParams
    from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec, Stage
    from spindle.engine_config import EngineConfig
    from spindle.infer.generator import DiffusionGenerator, GenerationResult
    from spindle.infer.pipeline import InferencePipeline
    from spindle.infer.quality import psnr
    from spindle.infer.stages import DecodingStage, DenoisingStage

_LAZY = {
    "Cancelled": "spindle.contracts.request",
    "Req": "spindle.contracts.request",
    "RequestError": "spindle.contracts.request",
    "SamplingParams": "spindle.contracts.request",
    "DiffusionGenerator": "spindle.infer.generator",
    "GenerationResult": "spindle.infer.generator",
    "psnr": "spindle.infer.quality",
    "EngineConfig": "spindle.engine_config",
    "InferencePipeline": "spindle.infer.pipeline",
    "InferenceSpec": "spindle.contracts.stage",
    "BeforeDenoisingStage": "spindle.contracts.stage",
    "DenoisingStage": "spindle.infer.stages",
    "DecodingStage": "spindle.infer.stages",
    "Stage": "spindle.contracts.stage",
}

# Literal strings (not `*_LAZY`): static tools read `__all__` without running the module.
# tests/infer/test_infer_api.py checks that it lists exactly the eager names plus `_LAZY`.
__all__ = [
    "BeforeDenoisingStage",
    "Cancelled",
    "DecodingStage",
    "DenoisingStage",
    "DiffusionGenerator",
    "EngineConfig",
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
