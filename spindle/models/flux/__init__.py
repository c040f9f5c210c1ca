"""FLUX.1 text-to-image (diffusers `FluxPipeline` / `FluxTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
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
    conformance=ConformanceSpec(
        # Flux's guidance_scale is embedded guidance; classifier-free guidance is true_cfg_scale
        parity_cases=decl.parity_cases(
            cfg=dict(guidance_scale=3.5, true_cfg_scale=4.0, seed=7),
            nocfg=dict(guidance_scale=4.0, seed=0),
            max_sequence_length=16,
        ),
        # FluxPipeline's: no true CFG by default
        default_params=decl.image_default_params(1.0, num_frames=None, num_inference_steps=28, guidance_scale=3.5),
        request_errors=(
            decl.multiple_error("height", 30, 4, "28 or 32", why=decl.PACKING),
            decl.multiple_error("width", 2, 4, "4"),
            decl.text_length_error(512),
        ),
        # the embedded --guidance flag
        cli_case=dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=3.5, seed=4),
    ),
)
