"""A tiny random Qwen2.5-VL in the transformers layout (`spindle tiny-model qwen2_5_vl`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_vlm import TINY_DECODER, TINY_TOWER, build_tiny_vlm

# Qwen2.5-VL's structure, scaled down: GQA, mrope over (t, h, w) sections summing to head_dim / 2, a
# windowed vision tower with one full-attention block, 14-pixel patches merged 2x2.
TINY_TEXT = dict(
    TINY_DECODER, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
)
TINY_VISION = dict(TINY_TOWER, patch_size=14, window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # No video_preprocessor_config.json, as the published Qwen2.5-VL checkpoints: stock's Qwen2VLVideoProcessor
    # (and Spindle, spindle.data.stock_video) reads preprocessor_config.json for videos, min/max_pixels a frame.
    return build_tiny_vlm("qwen2_5_vl", out, TINY_TEXT, TINY_VISION, seed=seed, transformer=transformer)
