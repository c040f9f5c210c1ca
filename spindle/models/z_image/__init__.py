"""Z-Image(-Turbo) text-to-image (diffusers `ZImagePipeline` / `ZImageTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl

MAX_SEQUENCE_LENGTH = 1024  # the longest prompt Spindle encodes for Z-Image, in tokens


def _looks_like_z_image(root: Path) -> bool:
    """Renamed local folders: a transformer config with Z-Image's caption width key."""
    return decl.config_mentions(root, "transformer", '"cap_feat_dim"')


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(guidance="classifier-free guidance scale (> 0 enables CFG; Z-Image-Turbo samples with 0)")

FAMILY = DiTFamily(
    name="z_image",
    checkpoint=DiffusersCheckpoint("ZImagePipeline", "ZImageTransformer2DModel", detect=_looks_like_z_image),
    options=OPTIONS,
    # 64x64: 4x4 patches at the tiny VAE's x8 (32x32 would leave the overfit 2x2)
    demo=decl.demo(decl.IMAGE_DEMO, size=(64, 64), sample_kwargs={"guidance_scale": 0.0}),
    conformance=ConformanceSpec(
        parity_cases=decl.parity_cases(
            cfg=dict(guidance_scale=4.0, seed=7),
            nocfg=dict(guidance_scale=0.0, seed=0),  # Z-Image-Turbo's setting
            max_sequence_length=16,
        ),
        # ZImageTransformer2DModel has no `_cp_plan` (it takes lists of variable-length samples)
        sequence_parallel=(),
        # ZImagePipeline.__call__ defaults: 1024x1024 whatever the VAE, guidance 5 (CFG with "")
        default_params=dict(
            height=1024, width=1024, num_inference_steps=50, guidance_scale=5.0, max_sequence_length=512, extra={}
        ),
        stock_size=1024,  # ZImagePipeline.__call__'s `height or 1024` (it has no default_sample_size)
        request_errors=(
            decl.multiple_error("height", 30, 16, "16 or 32", why="VAE x8 x 2x2 packing"),
            decl.text_length_error(MAX_SEQUENCE_LENGTH),
        ),
        cli_case=dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=2.0, seed=4),
    ),
)
