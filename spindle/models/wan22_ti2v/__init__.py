"""Wan2.2 TI2V-5B: a stock `WanPipeline` folder with `expand_timesteps` (one timestep per latent token) and the
Wan2.2 VAE (48 latent channels, 2x2 pixel patches: 16x spatial compression). Text-to-video, or, given an
image, image-to-video as stock `WanImageToVideoPipeline` runs the same folder: the first latent frame is
the VAE-encoded image (replaced, not concatenated, at every step) and its tokens get timestep 0."""

import dataclasses

from spindle.models.shared.declarations import VIDEO_DEMO, demo
from spindle.models.wan import OPTIONS as WAN_OPTIONS
from spindle.models.wan import pipeline_variant


def expands_timesteps(model_index: dict) -> bool:
    return bool(model_index.get("expand_timesteps"))


# Wan's options (num_frames = 4k + 1; Wan2.2 TI2V is trained at 24 fps) and an optional first frame
OPTIONS = dataclasses.replace(WAN_OPTIONS, fps=24, images=(0, 1))

FAMILY = pipeline_variant(
    "wan22_ti2v",
    expands_timesteps,
    options=OPTIONS,
    # 64x64: the 16x VAE and 2x2 patches leave 2x2 tokens per latent frame (at 32x32, one)
    demo=demo(VIDEO_DEMO, size=(64, 64)),
)
