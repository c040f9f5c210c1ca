"""Wan2.2 TI2V-5B: a stock `WanPipeline` folder with `expand_timesteps` (one timestep per latent token) and the
Wan2.2 VAE (48 latent channels, 2x2 pixel patches: 16x spatial compression). Text-to-video, or, given an
image, image-to-video as stock `WanImageToVideoPipeline` runs the same folder: the first latent frame is
the VAE-encoded image (replaced, not concatenated, at every step) and its tokens get timestep 0."""

import dataclasses

from spindle.contracts.family import ConformanceSpec
from spindle.models.wan import FAMILY as WAN
from spindle.models.wan import OPTIONS as WAN_OPTIONS


def expands_timesteps(model_index: dict) -> bool:
    return bool(model_index.get("expand_timesteps"))


# Wan's options (num_frames = 4k + 1; Wan2.2 TI2V is trained at 24 fps) and an optional first frame
OPTIONS = dataclasses.replace(WAN_OPTIONS, fps=24, images=(0, 1))

_CFG = dict(
    prompt="a red fox in the snow",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=5.0,
    seed=0,
)
_NOCFG = dict(
    prompt="a red fox in the snow", height=32, width=64, num_frames=9, num_inference_steps=3, guidance_scale=1.0, seed=7
)

FAMILY = dataclasses.replace(
    WAN,
    name="wan22_ti2v",
    condition_model="spindle.models.wan22_ti2v.condition:Wan22TI2VConditionModel",
    inference="spindle.models.wan22_ti2v.inference:WAN22_TI2V_INFERENCE",
    tiny_model="spindle.models.wan22_ti2v.tiny:build_tiny_wan22_ti2v",
    detect=None,
    variant=expands_timesteps,
    options=OPTIONS,
    # 64x64: the 16x VAE and 2x2 patches leave 2x2 tokens per latent frame (at 32x32, one)
    demo=dataclasses.replace(WAN.demo, size=(64, 64), dataset_kwargs={**WAN.demo.dataset_kwargs, "size": (64, 64)})
    if WAN.demo
    else None,
    conformance=ConformanceSpec(
        # text-to-video through the folder's own pipeline (WanPipeline); image-to-video against stock
        # WanImageToVideoPipeline on the same folder: tests/infer/test_wan22_ti2v.py
        parity_cases={"cfg": _CFG, "nocfg": _NOCFG},
        request_errors=(
            (dict(height=48), r"height must be a positive multiple of 32 .*got 48.*try 32 or 64"),
            (dict(width=40), r"width must be a positive multiple of 32 .*got 40.*try 32 or 64"),
            (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
        ),
        default_params=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
    ),
)
