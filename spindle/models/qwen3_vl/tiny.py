"""A tiny random Qwen3-VL in the transformers layout (`spindle tiny-model qwen3_vl`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_vlm import QWEN3_VL_CHAT_TEMPLATE, TINY_DECODER, TINY_TOWER, build_tiny_vlm

# Qwen3-VL's structure, scaled down: q/k-normed GQA decoder with interleaved mrope, a vision tower with
# learned (interpolated) position embeddings, 16-pixel patches merged 2x2, one deepstack layer.
TINY_TEXT = dict(
    TINY_DECODER,
    head_dim=16,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
)
TINY_VISION = dict(TINY_TOWER, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0])
# Qwen3-VL's processor: 0.5 mean/std normalisation, 32-pixel merged patches.
PROCESSOR = dict(image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
# Qwen3-VL's video processor config (its own file, as the checkpoints ship it): its pixel budget is over the
# whole clip (frames x height x width), here 4 frames of 32x32 up to 16 frames of 64x64.
VIDEO_PROCESSOR = dict(
    video_processor_type="Qwen3VLVideoProcessor",
    size={"shortest_edge": 4 * 32 * 32, "longest_edge": 16 * 64 * 64},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    return build_qwen3_vl_like("qwen3_vl", out, TINY_TEXT, TINY_VISION, seed, transformer)


def build_qwen3_vl_like(
    model_type: str, out: str | Path, text: dict, vision: dict, seed: int = 0, transformer: dict | None = None
) -> Path:
    """A tiny `model_type` checkpoint with Qwen3-VL's processor side (template, image and video processors, pixel
    budget): Qwen3-VL and the families built on its tower (Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE). `transformer`'s
    "text_config" entries join `text` (the MoE builders' own keys stay)."""
    over = dict(transformer or {})
    return build_tiny_vlm(
        model_type,
        out,
        {**text, **over.pop("text_config", {})},
        vision,
        seed=seed,
        transformer={**over, "text_config": {}},
        min_pixels=32 * 32,
        max_pixels=64 * 64,
        chat_template=QWEN3_VL_CHAT_TEMPLATE,
        processor=PROCESSOR,
        video_processor=VIDEO_PROCESSOR,
    )
