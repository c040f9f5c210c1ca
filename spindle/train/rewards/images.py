"""The image conversions rewards share: decoded pixels -> the float arrays reward functions receive, and
those arrays -> 8-bit pixels, PNG (HTTP scorers) and JPEG (the compressibility rewards)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import torch


def reward_images(pixels: torch.Tensor) -> list[np.ndarray]:
    """Decoded samples in [0, 1], [B, 3, H, W] (images) or [B, 3, F, H, W] (videos), as reward functions get
    them: one float32 array per sample, [H, W, 3] or [F, H, W, 3], clipped to [0, 1]."""
    if pixels.ndim not in (4, 5) or pixels.shape[1] != 3:
        raise ValueError(f"pixels must be [B, 3, H, W] or [B, 3, F, H, W]; got {tuple(pixels.shape)}")
    channels_last = pixels.permute(0, 2, 3, 1) if pixels.ndim == 4 else pixels.permute(0, 2, 3, 4, 1)
    array = channels_last.detach().float().clamp(0, 1).cpu().numpy()
    return [np.ascontiguousarray(a) for a in array]


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
