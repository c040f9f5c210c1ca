"""FLUX.1 text-to-image (diffusers `FluxPipeline` / `FluxTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl


def _looks_like_flux(root: Path) -> bool:
    """Renamed local folders: two text encoders (CLIP + T5) next to a Flux transformer config."""
    return decl.config_mentions(root, "transformer", '"pooled_projection_dim"') and (root / "text_encoder_2").is_dir()


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(
    extra=(decl.true_cfg_scale(1.0),),  # FluxPipeline's default: no true CFG
    guidance="embedded guidance of guidance-distilled checkpoints (FLUX.1-dev; ignored by schnell-style ones); "
    "CFG is true_cfg_scale",
)

FAMILY = DiTFamily(
    name="flux",
    checkpoint=DiffusersCheckpoint("FluxPipeline", "FluxTransformer2DModel", detect=_looks_like_flux),
    options=OPTIONS,
    # the embedded guidance the model was fine-tuned with
    demo=decl.demo(decl.IMAGE_DEMO, sample_kwargs={"guidance_scale": 3.5}),
)
