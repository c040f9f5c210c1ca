"""Seeded noise images for the conformance cases of image-conditioned families (light: numpy and PIL
imported when called, so a family's registration stays free of heavy imports)."""

from __future__ import annotations

from typing import Any


def noise_image(height: int, width: int, seed: int = 0) -> Any:
    """An RGB PIL image of seeded uniform noise: a conditioning image whose size the request does not have."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
