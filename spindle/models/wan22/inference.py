"""Wan2.2 A14B text-to-video inference: Wan's spec and stages with the two-expert part (`experts.py`), which
Wan's code calls to load the second expert and switch to it at the boundary."""

from __future__ import annotations

from spindle.models.wan.inference import WanInference
from spindle.models.wan22 import OPTIONS
from spindle.models.wan22.experts import TWO_EXPERTS


class Wan22Inference(WanInference):
    options = OPTIONS
    family = "wan22"
    experts = TWO_EXPERTS


INFERENCE = Wan22Inference()
