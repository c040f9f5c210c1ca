"""FLUX.2 [klein] (diffusers `Flux2KleinPipeline` around a `Flux2Transformer2DModel`, a Qwen3 text encoder): FLUX.2's
classes with Klein's guidance part (classifier-free guidance on an empty negative prompt; none on the
step-distilled checkpoints, `is_distilled`). Shares the folder of `flux2`."""

import dataclasses

from spindle.models.flux2 import FAMILY as FLUX2
from spindle.models.flux2 import KLEIN_OPTIONS

TEXT_TOKENS = 32  # the tiny checks' text length: Qwen3's chat template around the prompt
assert FLUX2.demo is not None

FAMILY = dataclasses.replace(
    FLUX2,
    name="flux2_klein",
    # Flux2Transformer2DModel is flux2's too: the pipeline class decides (spindle.registry)
    checkpoint=dataclasses.replace(FLUX2.checkpoint, pipeline="Flux2KleinPipeline", detect=None),
    package="spindle.models.flux2",  # the folder it shares with `flux2`
    code={
        "condition_model": "spindle.models.flux2.condition:Flux2KleinConditionModel",
        "inference": "spindle.models.flux2.inference:KLEIN_INFERENCE",
        "tiny_model": "spindle.models.flux2.tiny:build_tiny_klein",
        "lora_original": "spindle.models.flux2.lora:to_original",  # the same transformer: BFL's LoRA layout
    },
    options=KLEIN_OPTIONS,
    demo=dataclasses.replace(FLUX2.demo, text_tokens=TEXT_TOKENS),
)
