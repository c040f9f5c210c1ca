"""FLUX.2 text-to-image and multi-reference editing: FLUX.2-dev (diffusers `Flux2Pipeline` /
`Flux2Transformer2DModel`, a Mistral3 text encoder) here, and FLUX.2 [klein] (`Flux2KleinPipeline`, a Qwen3 text
encoder) in `klein.py`, the same classes holding Klein's guidance part (`guidance.py`). Optional reference
images (`image`) are appended as tokens after the latents' (the reference-tokens part), as the pipelines do.
"""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl


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


FAMILY = DiTFamily(
    name="flux2",
    checkpoint=DiffusersCheckpoint("Flux2Pipeline", "Flux2Transformer2DModel", detect=_looks_like_flux2),
    options=OPTIONS,
    demo=decl.demo(decl.IMAGE_DEMO, sample_kwargs={"guidance_scale": 4.0}, text_tokens=TEXT_TOKENS),
)
