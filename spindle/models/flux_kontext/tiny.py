"""A tiny random FLUX.1 Kontext pipeline in the diffusers layout (`spindle tiny-model flux_kontext`): the Flux
tiny components (`spindle.models.flux.tiny`) saved as a `FluxKontextPipeline`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.models.flux.tiny import build_tiny as build_tiny_flux


def build_tiny(out: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random FLUX.1 Kontext pipeline to `out`; overrides as `build_tiny_flux`'s."""
    return build_tiny_flux(out, seed, pipeline="FluxKontextPipeline", **overrides)
