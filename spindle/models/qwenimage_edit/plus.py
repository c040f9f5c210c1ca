"""Qwen-Image-Edit-2509 and later (diffusers `QwenImageEditPlusPipeline`): Qwen-Image-Edit with 1 to 3
input images, each a "Picture N:" in the prompt (seen at `condition_image_area`) and a reference
latent sequence (at `image_area`). Shares the folder of `qwenimage_edit`."""

import dataclasses

from spindle.models.qwenimage_edit import DEMO as EDIT_DEMO
from spindle.models.qwenimage_edit import FAMILY as EDIT_FAMILY
from spindle.models.qwenimage_edit import PLUS_OPTIONS

FAMILY = dataclasses.replace(
    EDIT_FAMILY,
    name="qwenimage_edit_plus",
    # a renamed folder is taken for the single-image pipeline (`qwenimage_edit`)
    checkpoint=dataclasses.replace(EDIT_FAMILY.checkpoint, pipeline="QwenImageEditPlusPipeline", detect=None),
    package="spindle.models.qwenimage_edit",  # the folder it shares with `qwenimage_edit`
    code={
        "condition_model": "spindle.models.qwenimage_edit.condition:QwenImageEditPlusConditionModel",
        "inference": "spindle.models.qwenimage_edit.inference:QWENIMAGE_EDIT_PLUS_INFERENCE",
        "tiny_model": "spindle.models.qwenimage_edit.tiny:build_tiny_qwenimage_edit_plus",
    },
    options=PLUS_OPTIONS,
    # 64x32 samples: the target's 2 tokens and the suite's 2 sources' 2 each split evenly over 2 SP ranks
    demo=dataclasses.replace(EDIT_DEMO, size=(64, 32), dataset_kwargs={**EDIT_DEMO.dataset_kwargs, "size": (64, 32)}),
)
