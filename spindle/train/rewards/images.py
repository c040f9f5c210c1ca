"""The image conversions rewards share: the engine's decoded samples -> the float arrays reward functions
receive, and those arrays -> 8-bit pixels, PNG (HTTP scorers) and JPEG (the compressibility rewards)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np


def reward_images(output: Any) -> list[np.ndarray]:
    """The engine's decoded samples (`DecodingStage`'s `req.output`, `GenerationResult.frames`: [B, H, W, 3]
    images or [B, F, H, W, 3] videos in [0, 1]) as reward functions get them: one float32 array per sample,
    [H, W, 3] or [F, H, W, 3], clipped to [0, 1]."""
    array = np.asarray(output, dtype=np.float32)
    if array.ndim not in (4, 5) or array.shape[-1] != 3:
        raise ValueError(f"decoded samples must be [B, H, W, 3] or [B, F, H, W, 3]; got {array.shape}")
    return [np.ascontiguousarray(np.clip(a, 0.0, 1.0)) for a in array]


def to_uint8(image: np.ndarray) -> np.ndarray:
    """[..., 3] floats in [0, 1] -> uint8, rounded (as DDPO and Flow-GRPO quantise before encoding)."""
    return np.asarray(np.round(np.clip(image, 0.0, 1.0) * 255), dtype=np.uint8)


def frames(sample: np.ndarray) -> list[np.ndarray]:
    """A sample's frames: an image [H, W, 3] is one, a video [F, H, W, 3] is F."""
    if sample.ndim == 3:
        return [sample]
    if sample.ndim == 4:
        return list(sample)
    raise ValueError(f"a reward sample must be [H, W, 3] or [F, H, W, 3]; got shape {sample.shape}")


def encode(image: np.ndarray, fmt: str, **options: Any) -> bytes:
    """One [H, W, 3] float image encoded by Pillow (PNG, JPEG, ...)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png_base64(sample: np.ndarray) -> str | list[str]:
    """An image as a base64 PNG; a video as the list of its frames' base64 PNGs."""
    encoded = [base64.b64encode(encode(f, "PNG")).decode("ascii") for f in frames(sample)]
    return encoded[0] if sample.ndim == 3 else encoded
