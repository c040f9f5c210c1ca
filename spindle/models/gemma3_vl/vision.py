"""Gemma 3's dummy vision forward (`VLMFamily.vision_dummy`): what a text-only micro-batch runs so that every
rank runs the vision side's FSDP2 collectives and every vision parameter gets its (zero) gradient."""

from __future__ import annotations

from typing import Any

import torch


def dummy_vision(model: Any, like: torch.Tensor) -> torch.Tensor:
    """Zero times the soft tokens of one blank image: the SigLIP tower and the multi-modal projector (which the
    model runs after the tower, so its parameters take part too), in the tower's dtype (as the model casts
    pixels)."""
    inner = model.model
    size = int(inner.config.vision_config.image_size)
    pixels = torch.zeros(1, 3, size, size, device=like.device, dtype=inner.vision_tower.dtype)
    zero: torch.Tensor = inner.get_image_features(pixels).pooler_output.sum() * 0.0
    return zero
