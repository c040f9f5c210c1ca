"""A tiny random Qwen3.5 in the transformers layout (`spindle tiny-model qwen3_5`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.qwen3_vl.tiny import TINY_TEXT as QWEN3_VL_TEXT
from spindle.models.qwen3_vl.tiny import build_qwen3_vl_like
from spindle.models.shared.tiny_vlm import TINY_TOWER

# Qwen3.5's structure, scaled down: four decoder layers, three Gated DeltaNet linear-attention layers then one
# full-attention layer (its `full_attention_interval` 4), partial rotary embeddings (a quarter of each head) with
# interleaved mrope, a Qwen3-VL-style vision tower without deepstack.
TINY_TEXT = dict(
    QWEN3_VL_TEXT,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    partial_rotary_factor=0.25,
    head_dim=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    },
)
TINY_VISION = dict(TINY_TOWER, patch_size=16, num_position_embeddings=16)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    return build_qwen3_vl_like("qwen3_5", out, TINY_TEXT, TINY_VISION, seed, transformer)
