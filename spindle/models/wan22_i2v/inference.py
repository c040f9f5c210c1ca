"""Wan2.2 A14B image-to-video inference: Wan I2V's stages with the expert switch (`spindle.models.wan22.experts`)."""

from __future__ import annotations

from spindle.models.wan22.experts import TwoExpertInference, TwoExpertStage
from spindle.models.wan22_i2v import OPTIONS
from spindle.models.wan_i2v.inference import WanI2VBeforeDenoisingStage, WanI2VInference


class Wan22I2VBeforeDenoisingStage(TwoExpertStage, WanI2VBeforeDenoisingStage):
    pass


class Wan22I2VInference(TwoExpertInference, WanI2VInference):
    options = OPTIONS
    family = "wan22_i2v"
    # no CLIP image encoder in Wan2.2 folders (model_index.json names none)
    components = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    before_denoising_cls = Wan22I2VBeforeDenoisingStage


INFERENCE = Wan22I2VInference()
