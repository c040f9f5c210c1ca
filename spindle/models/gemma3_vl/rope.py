"""Gemma 3's positions of one document: 1-D, the text positions (its decoder has no multimodal RoPE), so the
family adds no RoPE rows to them (spindle.data.multimodal.model_positions)."""

from __future__ import annotations

from typing import Any

import torch


def rope_index(config: Any, input_ids: torch.Tensor, *grids: Any, **_: Any) -> torch.Tensor:
    """No multimodal RoPE rows: [0, 1, L]."""
    return torch.zeros(0, *input_ids.shape, dtype=torch.long)
