"""Tiny random checkpoints for tests: each family's registered builder (`FAMILY.tiny_model`, in its
folder), by family name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.contracts.family import import_object
from spindle.registry import get_family


def build_tiny(family: str, out: str | Path, seed: int = 0, **overrides: Any) -> Path:
    record = get_family(family)
    if record.tiny_model is None:
        raise ValueError(f"family {family!r} registers no tiny_model builder")
    path: Path = import_object(record.tiny_model)(out, seed=seed, **overrides)
    return path
