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

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import Option
from spindle.models.flux import FAMILY as FLUX
from spindle.models.flux import OPTIONS as FLUX_OPTIONS
from spindle.models.shared.declarations import EDIT_DEMO, demo, text_length_error
from spindle.models.shared.test_images import noise_image  # the suite's seeded conditioning image

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
# the stock pipeline's name of each Spindle option that differs (the suite calls it with these)
STOCK_NAMES = {"auto_resize": "_auto_resize"}


assert FLUX.conformance is not None
FAMILY = DiTFamily(
    name="flux_kontext",
    # FluxTransformer2DModel is flux's too: the pipeline class decides (spindle.registry)
    checkpoint=DiffusersCheckpoint("FluxKontextPipeline", "FluxTransformer2DModel"),
    # the same transformer: BFL's LoRA layout, read back by diffusers' Flux reader
    code={"lora_original": FLUX.lora_original},
    options=OPTIONS,
    # validation/demo samples at the training size: the output keeps it, the source its own size
    demo=demo(EDIT_DEMO, sample_kwargs={"guidance_scale": 2.5, "max_area": 32 * 32, "auto_resize": False}),
    conformance=ConformanceSpec(
        # Flux's cases editing the seeded image at their own size (max_area = height x width, no auto-resize), the
        # CFG one at Kontext's embedded guidance
        parity_cases={
            name: case
            | dict(
                prompt="the red circle to blue",
                image=noise_image(40, 56),
                max_area=case["height"] * case["width"],
                auto_resize=False,
            )
            | ({"guidance_scale": 2.5} if name == "cfg" else {})
            for name, case in FLUX.conformance.parity_cases.items()
        },
        stock_names=STOCK_NAMES,
        train_sources=1,
        train_request={"auto_resize": False},  # training's sources have the target's size
        # FluxKontextPipeline's __call__: no size (its default_sample_size x VAE factor, fitted to max_area)
        default_params=FLUX.conformance.default_params
        | dict(height=None, width=None, extra={"true_cfg_scale": 1.0, "max_area": MAX_AREA, "auto_resize": True}),
        request_errors=(
            FLUX.conformance.request_errors[0],
            (
                dict(max_area=1024),
                r"max_area=1024: FluxKontextPipeline would generate 24x36, not the asked 32x48 \(it scales "
                r"height x width to max_area pixels\); give max_area=1536 to keep 32x48, or ask height=24, width=36",
            ),
            text_length_error(512),
        ),
        # --true-cfg-scale with the sizing flags that keep the tiny model's small size
        cli_case=dict(
            prompt="a cat",
            negative_prompt="blurry",
            height=32,
            width=48,
            max_area=32 * 48,
            num_inference_steps=2,
            true_cfg_scale=4.0,
            seed=4,
        ),
        cli_option="true_cfg_scale",
    ),
)
