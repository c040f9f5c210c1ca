"""Wan2.2 A14B text-to-video inference: Wan's stages with the expert switch (`experts.py`)."""

from __future__ import annotations

from spindle.models.wan.inference import WanBeforeDenoisingStage, WanInference
from spindle.models.wan22 import OPTIONS
from spindle.models.wan22.experts import TwoExpertInference, TwoExpertStage


class Wan22BeforeDenoisingStage(TwoExpertStage, WanBeforeDenoisingStage):
    pass


class Wan22Inference(TwoExpertInference, WanInference):
    options = OPTIONS
    family = "wan22"
    before_denoising_cls = Wan22BeforeDenoisingStage


INFERENCE = Wan22Inference()
