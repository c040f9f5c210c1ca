"""A tiny random Wan2.2 I2V-A14B pipeline in the diffusers layout (`spindle tiny-model wan22_i2v`): the tiny
Wan I2V folder without an image encoder (Wan2.2's I2V layout) plus the second expert."""

from __future__ import annotations

from pathlib import Path

from spindle.models.wan22.tiny import add_second_expert
from spindle.models.wan_i2v.tiny import build_tiny as build_tiny_wan_i2v


def build_tiny(out: str | Path, seed: int = 0, **overrides: dict | None) -> Path:
    """A tiny random Wan2.2 I2V-A14B pipeline (`WanImageToVideoPipeline` with two experts, no CLIP)."""
    return add_second_expert(build_tiny_wan_i2v(out, seed, clip=False, **overrides), seed)
