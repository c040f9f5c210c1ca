"""Parts of the tiny random checkpoints every family builds (`spindle tiny-model`): seeded construction
and latent statistics. No weights can be downloaded here, so tests, the demo and the benchmarks build
their checkpoints locally, in the exact standard layouts, and the real loading code runs on them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def random_latent_stats(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Non-trivial per-channel latent mean/std so that normalization bugs show up in tests."""
    g = torch.Generator().manual_seed(seed + 7)
    mean = (torch.rand(z_dim, generator=g) - 0.5).tolist()
    std = (0.5 + 1.5 * torch.rand(z_dim, generator=g)).tolist()
    return [round(x, 4) for x in mean], [round(x, 4) for x in std]


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    torch.manual_seed(seed)
    return build()


def save_seeded_pipeline(
    pipeline_cls: Any,
    out: str | Path,
    seed: int,
    *,
    text_encoder: Callable[[], Any],
    vae: Callable[[], Any],
    transformer: Callable[[], Any],
    **parts: Any,
) -> Path:
    """`pipeline_cls(**parts, text_encoder=..., vae=..., transformer=...)` saved to `out` (safetensors), its
    models built seeded with seed, seed + 1 and seed + 2 (each on its own, so `--seed` reproduces a
    checkpoint); a family's further models (a second text encoder) come built in `parts`."""
    pipe = pipeline_cls(
        **parts,
        text_encoder=seeded(seed, text_encoder),
        vae=seeded(seed + 1, vae),
        transformer=seeded(seed + 2, transformer),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return Path(out)
