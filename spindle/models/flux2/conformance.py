"""The conformance specs of FLUX.2 (`FLUX2`) and FLUX.2 [klein] (`FLUX2_KLEIN`): how the conformance suite exercises them.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.flux2 import TEXT_TOKENS
from spindle.models.flux2.klein import TEXT_TOKENS as KLEIN_TEXT_TOKENS
from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec, noise_image

# `spindle generate` on the tiny checkpoint (the embedded --guidance flag)
CLI_CASE = dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=2.5, seed=4)


def conformance(
    parity_cases: dict[str, dict], text_tokens: int, *errors: tuple[dict, str], no_cfg: str = ""
) -> ConformanceSpec:
    """Both FLUX.2 families' conformance spec: their pipelines' call defaults and the request rows they share."""
    # two reference images of different sizes (the pipelines take images of at least 64 pixels a side): the output
    # takes the first's size, each image's tokens their own time offset
    references = dict(
        prompt="the red circle to blue",
        image=[noise_image(64, 80), noise_image(72, 64, seed=1)],
        num_inference_steps=2,
        guidance_scale=2.5,
        seed=5,
    )
    return ConformanceSpec(
        no_cfg=no_cfg,
        parity_cases={
            name: case | dict(max_sequence_length=text_tokens)
            for name, case in {**parity_cases, "references": references}.items()
        },
        # both pipelines' __call__: no size (the first reference image's, else 128 latent pixels x VAE factor), 50
        # steps, guidance 4, 512 text tokens
        default_params=dict(
            height=None,
            width=None,
            num_frames=None,
            num_inference_steps=50,
            guidance_scale=4.0,
            max_sequence_length=512,
        ),
        request_errors=(
            shared.multiple_error("height", 30, 4, "28 or 32", why=shared.PACKING),
            shared.multiple_error("width", 2, 4, "4"),
            shared.text_length_error(512),
            *errors,
        ),
        cli_case=CLI_CASE,
        text_tokens=text_tokens,
    )


FLUX2 = conformance(
    # guidance-distilled: no classifier-free guidance case (Flux2Pipeline has none); two embedded guidances
    {
        "square": dict(prompt=shared.PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=2.5, seed=7),
        "nocfg": dict(prompt=shared.PROMPT, height=32, width=48, num_inference_steps=3, guidance_scale=4.0, seed=0),
    },
    TEXT_TOKENS,
    (
        dict(negative_prompt="blurry"),
        r"negative_prompt: FLUX.2-dev \(Flux2Pipeline\) has no classifier-free guidance",
    ),
    no_cfg="Flux2Pipeline is guidance-distilled: guidance_scale is embedded, there is no negative prompt",
)


FLUX2_KLEIN = conformance(
    # CFG as Flux2KleinPipeline runs it: guidance_scale > 1 against the empty negative prompt (its __call__
    # takes no negative_prompt); none at guidance 1
    {
        "cfg": dict(prompt=shared.PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=4.0, seed=7),
        "nocfg": dict(prompt=shared.PROMPT, height=32, width=48, num_inference_steps=3, guidance_scale=1.0, seed=0),
    },
    KLEIN_TEXT_TOKENS,
)
