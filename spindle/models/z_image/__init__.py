"""Z-Image(-Turbo) text-to-image (diffusers `ZImagePipeline` / `ZImageTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
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
)
