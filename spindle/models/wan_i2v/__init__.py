"""Wan2.1 image-to-video (diffusers `WanImageToVideoPipeline` around a `WanTransformer3DModel` whose input
carries the conditioning channels): Wan T2V plus a conditioning image, through the CLIP image encoder and
the VAE-encoded first frame with its frame mask."""

import dataclasses

from spindle.contracts.family import DiTFamily
from spindle.models.wan import OPTIONS as WAN_OPTIONS

# Wan's options (16 fps, num_frames = 4k + 1) and exactly one conditioning image
OPTIONS = dataclasses.replace(WAN_OPTIONS, images=(1, 1))
# The transformer splits its cross-attention context at a hard-coded 512 text tokens (diffusers'
# WanAttnProcessor: image tokens first, then 512 text tokens), so the text is always 512 tokens long.
TEXT_LENGTH = 512

FAMILY = DiTFamily(
    name="wan_i2v",
    pipeline_classes=("WanImageToVideoPipeline",),
    # WanTransformer3DModel is served by `wan` too: the pipeline class decides (spindle.registry)
    transformer_classes=(),
    condition_model="spindle.models.wan_i2v.condition:WanI2VConditionModel",
    inference="spindle.models.wan_i2v.inference:WAN_I2V_INFERENCE",
    tiny_model="spindle.models.wan_i2v.tiny:build_tiny_wan_i2v",
    lora_original="spindle.models.wan.lora:to_original",
    options=OPTIONS,
)
