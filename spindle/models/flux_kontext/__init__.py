"""FLUX.1 Kontext image editing (diffusers `FluxKontextPipeline` around a `FluxTransformer2DModel`): Flux
text-to-image plus a source image whose VAE latents are appended to the noisy latents' token sequence
(image ids offset to 1 on their first axis), with the pipeline's own sizing of input and output.

Sizing, as FluxKontextPipeline does it:
- the output is `height` x `width` scaled to `max_area` pixels at the asked aspect ratio, rounded down to
  the VAE factor x 2 (1024 x 1024 by default on FLUX.1 Kontext). Spindle never changes the asked size
  silently: a request the pipeline would resize is a RequestError naming `max_area` and the values that
  keep the size (`max_area = height x width`);
- the source image is resized to the preferred Kontext resolution nearest its aspect ratio
  (`auto_resize`, the pipeline's `_auto_resize`, on by default); `auto_resize=False` keeps its own size
  (rounded down to the VAE factor x 2, as the pipeline does).
"""

import dataclasses

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import Option
from spindle.models.flux import FAMILY as FLUX
from spindle.models.flux import OPTIONS as FLUX_OPTIONS
from spindle.models.shared.declarations import EDIT_DEMO, demo

MAX_AREA = 1024**2  # FluxKontextPipeline's default max_area

OPTIONS = dataclasses.replace(
    FLUX_OPTIONS,
    extra=(
        *FLUX_OPTIONS.extra,
        Option(
            "max_area",
            int,
            default=MAX_AREA,
            minimum=1,
            help="output pixels: height x width is scaled to this area at its aspect ratio (FluxKontextPipeline's "
            "sizing); a request it would resize is refused: give max_area = height x width to keep the size",
            output_area=True,  # the HTTP `size` (OpenAI's output size) sets it to width x height
        ),
        Option(
            "auto_resize",
            bool,
            default=True,
            help="resize the source image to the preferred Kontext resolution nearest its aspect ratio "
            "(FluxKontextPipeline's _auto_resize); false keeps its size",
            resizes_input=True,  # off when the HTTP `size` gives the output size (OpenAI's semantics)
        ),
    ),
    images=(0, 1),  # one source image to edit; none: plain text-to-image, as the pipeline allows
)


FAMILY = DiTFamily(
    name="flux_kontext",
    # FluxTransformer2DModel is flux's too: the pipeline class decides (spindle.registry)
    checkpoint=DiffusersCheckpoint("FluxKontextPipeline", "FluxTransformer2DModel"),
    # the same transformer: BFL's LoRA layout, read back by diffusers' Flux reader
    code={"lora_original": FLUX.lora_original},
    options=OPTIONS,
    # validation/demo samples at the training size: the output keeps it, the source its own size
    demo=demo(EDIT_DEMO, sample_kwargs={"guidance_scale": 2.5, "max_area": 32 * 32, "auto_resize": False}),
)
