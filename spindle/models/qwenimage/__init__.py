"""Qwen-Image text-to-image (diffusers `QwenImagePipeline` / `QwenImageTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl


def _looks_like_qwenimage(root: Path) -> bool:
    """Renamed local folders: a Qwen2.5-VL text encoder next to a Qwen-Image VAE."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLQwenImage"')


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(
    extra=(decl.true_cfg_scale(4.0),),  # QwenImagePipeline's default: CFG runs once a negative_prompt is given
    guidance="embedded guidance of guidance-distilled variants (ignored by Qwen-Image itself); CFG is true_cfg_scale",
)

FAMILY = DiTFamily(
    name="qwenimage",
    checkpoint=DiffusersCheckpoint("QwenImagePipeline", "QwenImageTransformer2DModel", detect=_looks_like_qwenimage),
    options=OPTIONS,
    demo=decl.demo(decl.IMAGE_DEMO, sample_kwargs={"negative_prompt": "", "true_cfg_scale": 4.0}),
)
