"""Tiny random Wan2.2 A14B pipelines in the diffusers layout (`spindle tiny-model wan22` / `wan22_i2v`):
a single-transformer tiny Wan folder plus a second, differently seeded expert in `transformer_2` and
`boundary_ratio` in model_index.json, as the Wan2.2 A14B Diffusers folders have them."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny import seeded, update_model_index
from spindle.models.wan.tiny import build_tiny as build_tiny_wan

BOUNDARY_RATIO = 0.875  # Wan2.2 T2V-A14B's; the tiny schedules (shift 3) have steps on both sides of it


def add_second_expert(out: Path, seed: int, boundary_ratio: float = BOUNDARY_RATIO) -> Path:
    """Write `out/transformer_2` (the config of `out/transformer`, its own seeded weights) and name it, with
    `boundary_ratio`, in model_index.json."""
    from diffusers import WanTransformer3DModel

    config = WanTransformer3DModel.load_config(out / "transformer")
    expert = seeded(seed + 5, lambda: WanTransformer3DModel.from_config(config).eval())
    expert.save_pretrained(out / "transformer_2", safe_serialization=True)
    return update_model_index(out, transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=boundary_ratio)


def build_tiny(out: str | Path, seed: int = 0, **overrides: dict | None) -> Path:
    """A tiny random Wan2.2 T2V-A14B pipeline (`WanPipeline` with two experts); overrides as `build_tiny_wan`'s."""
    return add_second_expert(build_tiny_wan(out, seed, **overrides), seed)
