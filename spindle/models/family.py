"""A family's registration: `DiTFamily` and `DemoSpec`. Light (no torch, no diffusers), so the CLI
can read every family's declarations (e.g. its sampling options, for `spindle generate` flags)
without importing model code; the heavy parts are dotted paths resolved by `import_object`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spindle.infer.options import FamilyOptions


def import_object(path: str) -> Any:
    """'package.module:attr' -> attr (keeps family registration free of heavy imports)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DemoSpec:
    """What `spindle demo --family NAME` trains on and samples (no family branches in the command)."""

    dataset: str  # "module:function(out, seed=..., **dataset_kwargs)" writing a captioned media folder
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    size: tuple[int, int] = (32, 32)  # (height, width) for training and the sample
    num_frames: int = 1  # data.num_frames (1 for image families)
    sample_suffix: str = ".png"  # ".mp4" for video families
    sample_kwargs: dict[str, Any] = field(default_factory=dict)  # extra generate() arguments


@dataclass(frozen=True)
class DiTFamily:
    name: str
    pipeline_classes: tuple[str, ...]
    transformer_classes: tuple[str, ...]
    condition_model: str  # "module:Class" of a ConditionModel subclass
    inference: str | None = None  # "module:object" of the family's inference spec (infer/)
    tiny_model: str | None = None  # "module:function(out, seed, **overrides)"
    detect: Callable[[Path], bool] | None = None
    demo: DemoSpec | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    task: str = "flow_matching"  # the training task (spindle.train.tasks.TASKS)
    options: FamilyOptions = field(default_factory=FamilyOptions)  # sampling options (CLI flags, HTTP fields)

    def condition_model_cls(self) -> type:
        return import_object(self.condition_model)

    def inference_spec(self) -> Any:
        if self.inference is None:
            raise NotImplementedError(f"family {self.name!r} has no inference support yet")
        return import_object(self.inference)
