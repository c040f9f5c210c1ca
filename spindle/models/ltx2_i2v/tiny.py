"""A tiny random LTX-2 image-to-video pipeline in the diffusers layout (`spindle tiny-model ltx2_i2v`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.ltx2.tiny import save_ltx2_pipeline
from spindle.models.shared.tiny import Overrides


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random `LTX2ImageToVideoPipeline` (ltx2's components: the pipeline class is the difference) to
    `out`; return its path."""
    from diffusers import LTX2ImageToVideoPipeline

    return save_ltx2_pipeline(LTX2ImageToVideoPipeline, Path(out), seed, overrides)
