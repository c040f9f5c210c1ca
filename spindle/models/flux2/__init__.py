"""FLUX.2 text-to-image and multi-reference editing: FLUX.2-dev (diffusers `Flux2Pipeline` /
`Flux2Transformer2DModel`, a Mistral3 text encoder) here, and FLUX.2 [klein] (`Flux2KleinPipeline`, a Qwen3 text
encoder) in `klein.py`, the same classes holding Klein's guidance part (`guidance.py`). Optional reference
images (`image`) are appended as tokens after the latents' (the reference-tokens part), as the pipelines do.
"""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl
from spindle.models.shared.test_images import noise_image  # the suite's seeded conditioning images


def _looks_like_flux2(root: Path) -> bool:
    """Renamed local folders: a FLUX.2 VAE (batch-norm latents) next to a Mistral3 text encoder."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLFlux2"') and decl.config_mentions(
        root, "text_encoder", '"Mistral3ForConditionalGeneration"'
    )


# reference images a request takes: none (text-to-image) up to BFL's FLUX.2 limit of 10
REFERENCE_IMAGES = (0, 10)
# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(
    guidance="embedded guidance of the guidance-distilled FLUX.2-dev (Flux2Pipeline has no classifier-free guidance)",
    images=REFERENCE_IMAGES,
)
KLEIN_OPTIONS = FamilyOptions(
    guidance="classifier-free guidance scale (> 1 enables CFG against the negative prompt, empty by default, as "
    "Flux2KleinPipeline); ignored by step-distilled checkpoints (is_distilled)",
    images=REFERENCE_IMAGES,
)
TEXT_TOKENS = 64  # the tiny checks' text length: the system message (~40 tokens) and the prompt
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
            decl.multiple_error("height", 30, 4, "28 or 32", why=decl.PACKING),
            decl.multiple_error("width", 2, 4, "4"),
            decl.text_length_error(512),
            *errors,
        ),
        cli_case=CLI_CASE,
        text_tokens=text_tokens,
    )


FAMILY = DiTFamily(
    name="flux2",
    checkpoint=DiffusersCheckpoint("Flux2Pipeline", "Flux2Transformer2DModel", detect=_looks_like_flux2),
    options=OPTIONS,
    demo=decl.demo(decl.IMAGE_DEMO, sample_kwargs={"guidance_scale": 4.0}, text_tokens=TEXT_TOKENS),
    conformance=conformance(
        # guidance-distilled: no classifier-free guidance case (Flux2Pipeline has none); two embedded guidances
        {
            "square": dict(prompt=decl.PROMPT, height=32, width=32, num_inference_steps=2, guidance_scale=2.5, seed=7),
            "nocfg": dict(prompt=decl.PROMPT, height=32, width=48, num_inference_steps=3, guidance_scale=4.0, seed=0),
        },
        TEXT_TOKENS,
        (
            dict(negative_prompt="blurry"),
            r"negative_prompt: FLUX.2-dev \(Flux2Pipeline\) has no classifier-free guidance",
        ),
        no_cfg="Flux2Pipeline is guidance-distilled: guidance_scale is embedded, there is no negative prompt",
    ),
)
