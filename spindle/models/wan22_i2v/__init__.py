"""Wan2.2 A14B image-to-video: a stock `WanImageToVideoPipeline` with two experts (`transformer`,
`transformer_2`, split at `boundary_ratio`: `spindle.models.wan22.experts`) and no CLIP image encoder
(the transformers take no image embeddings): Wan2.1 I2V's conditioning (VAE-encoded first frame and
frame mask on the channel axis) with the expert switch; training fine-tunes the expert `train.expert` names."""

import dataclasses

from spindle.contracts.family import DemoSpec
from spindle.models.wan22.experts import GUIDANCE_SCALE_2, is_two_expert
from spindle.models.wan_i2v import FAMILY as WAN_I2V
from spindle.models.wan_i2v import OPTIONS as WAN_I2V_OPTIONS

OPTIONS = dataclasses.replace(WAN_I2V_OPTIONS, extra=(*WAN_I2V_OPTIONS.extra, GUIDANCE_SCALE_2))

assert WAN_I2V.demo is not None
FAMILY = dataclasses.replace(
    WAN_I2V,
    name="wan22_i2v",
    checkpoint=dataclasses.replace(WAN_I2V.checkpoint, variant=is_two_expert),
    options=OPTIONS,
    # no image tokens share the context: any text length
    # (and the demo fine-tunes the expert that denoises most of its steps)
    demo=dataclasses.replace(WAN_I2V.demo, text_tokens=DemoSpec.text_tokens, train={"expert": "low_noise"}),
)
