"""Wan2.2 A14B text-to-video: a stock `WanPipeline` with two experts (`transformer` for the high-noise
steps, `transformer_2` for the low-noise ones, split at `boundary_ratio`; see `experts.py`). Wan's
inference and condition model with the expert switch; training fine-tunes the expert `train.expert` names."""

import dataclasses

from spindle.models.wan import FAMILY as WAN
from spindle.models.wan import OPTIONS as WAN_OPTIONS
from spindle.models.wan import pipeline_variant
from spindle.models.wan22.experts import GUIDANCE_SCALE_2, is_two_expert

OPTIONS = dataclasses.replace(WAN_OPTIONS, extra=(*WAN_OPTIONS.extra, GUIDANCE_SCALE_2))

assert WAN.demo is not None
FAMILY = pipeline_variant(
    "wan22",
    is_two_expert,
    options=OPTIONS,
    # the demo fine-tunes the expert that denoises most of its steps
    demo=dataclasses.replace(WAN.demo, train={"expert": "low_noise"}),
)
