"""Wan2.1 image-to-video (diffusers `WanImageToVideoPipeline` around a `WanTransformer3DModel` whose input
carries the conditioning channels): Wan T2V plus a conditioning image, through the CLIP image encoder and
the VAE-encoded first frame with its frame mask."""

import dataclasses

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.models.shared.declarations import VIDEO_DEMO, demo
from spindle.models.wan import FAMILY as WAN
from spindle.models.wan import OPTIONS as WAN_OPTIONS

# Wan's options (16 fps, num_frames = 4k + 1); the first frame, and optionally the last one (FLF2V:
# WanImageToVideoPipeline's `last_image`, `generate(last_image=...)`), as the request's images
OPTIONS = dataclasses.replace(WAN_OPTIONS, images=(1, 2))
# The transformer splits its cross-attention context at a hard-coded 512 text tokens (diffusers'
# WanAttnProcessor: image tokens first, then 512 text tokens), so the text is always 512 tokens long.
TEXT_LENGTH = 512


FAMILY = DiTFamily(
    name="wan_i2v",
    # WanTransformer3DModel is `wan`'s too: the pipeline class decides (spindle.registry)
    checkpoint=DiffusersCheckpoint("WanImageToVideoPipeline", WAN.checkpoint.transformer),
    code={"lora_original": WAN.lora_original},  # the same transformer: Wan's LoRA layout
    options=OPTIONS,
    demo=demo(VIDEO_DEMO, text_tokens=TEXT_LENGTH),
)
