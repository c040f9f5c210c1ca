"""Wan2.2 A14B image-to-video inference: Wan I2V's spec and stages with the two-expert part
(`spindle.models.wan22.experts`), which Wan's code calls to load the second expert and switch to it."""

from __future__ import annotations

from spindle.models.wan22.experts import TWO_EXPERTS
from spindle.models.wan22_i2v import OPTIONS
from spindle.models.wan_i2v.inference import WanI2VInference


class Wan22I2VInference(WanI2VInference):
    options = OPTIONS
    family = "wan22_i2v"
    experts = TWO_EXPERTS
    # no CLIP image encoder in Wan2.2 folders (model_index.json names none)
    components = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")


INFERENCE = Wan22I2VInference()
