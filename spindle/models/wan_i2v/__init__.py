"""Wan2.1 image-to-video (diffusers `WanImageToVideoPipeline` around a `WanTransformer3DModel` whose input
carries the conditioning channels): Wan T2V plus a conditioning image, through the CLIP image encoder and
the VAE-encoded first frame with its frame mask."""

import dataclasses

from spindle.contracts.family import ConformanceSpec, DemoSpec, DiTFamily
from spindle.models.shared.test_images import noise_image  # the suite's seeded conditioning image
from spindle.models.wan import OPTIONS as WAN_OPTIONS

# Wan's options (16 fps, num_frames = 4k + 1); the first frame, and optionally the last one (FLF2V:
# WanImageToVideoPipeline's `last_image`, `generate(last_image=...)`), as the request's images
OPTIONS = dataclasses.replace(WAN_OPTIONS, images=(1, 2))
# The transformer splits its cross-attention context at a hard-coded 512 text tokens (diffusers'
# WanAttnProcessor: image tokens first, then 512 text tokens), so the text is always 512 tokens long.
TEXT_LENGTH = 512


FAMILY = DiTFamily(
    name="wan_i2v",
    pipeline_classes=("WanImageToVideoPipeline",),
    # WanTransformer3DModel is `wan`'s too: the pipeline class decides (spindle.registry)
    transformer_classes=("WanTransformer3DModel",),
    condition_model="spindle.models.wan_i2v.condition:WanI2VConditionModel",
    inference="spindle.models.wan_i2v.inference:WAN_I2V_INFERENCE",
    tiny_model="spindle.models.wan_i2v.tiny:build_tiny_wan_i2v",
    lora_original="spindle.models.wan.lora:to_original",
    options=OPTIONS,
    demo=DemoSpec(
        dataset="spindle.data.synthetic:make_shapes_video_dataset",
        dataset_kwargs={"num_videos": 16, "num_frames": 9, "size": (32, 32)},
        num_frames=9,
        sample_suffix=".mp4",
        sample_kwargs={"num_frames": 9, "guidance_scale": 1.0},
        text_tokens=TEXT_LENGTH,
    ),
    conformance=ConformanceSpec(
        parity_cases={
            "cfg": dict(
                prompt="a red fox in the snow",
                negative_prompt="blurry",
                image=noise_image(40, 56),
                height=32,
                width=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=5.0,
                seed=0,
            ),
            "nocfg": dict(
                prompt="a red fox in the snow",
                image=noise_image(40, 56),
                height=32,
                width=48,
                num_frames=9,
                num_inference_steps=3,
                guidance_scale=1.0,
                seed=7,
            ),
        },
        text_tokens=TEXT_LENGTH,
        default_params=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
    ),
)
