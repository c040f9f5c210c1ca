"""Wan2.1 text-to-video (diffusers `WanPipeline` / `WanTransformer3DModel`)."""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared.declarations import VIDEO_DEMO, config_mentions, demo


def _looks_like_wan(root: Path) -> bool:
    """Renamed local folders: a UMT5 text encoder next to a Wan VAE is Wan."""
    return config_mentions(root, "vae", '"AutoencoderKLWan"')


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
# Wan2.1 is trained on 16 fps video; its VAE compresses time 4x, so num_frames = 4k + 1
OPTIONS = FamilyOptions(fps=16, frame_multiple=4)

FAMILY = DiTFamily(
    name="wan",
    checkpoint=DiffusersCheckpoint("WanPipeline", "WanTransformer3DModel", detect=_looks_like_wan),
    options=OPTIONS,
    demo=demo(VIDEO_DEMO),
)


def pipeline_variant(name: str, variant: Callable[[dict[str, Any]], bool], **fields: Any) -> DiTFamily:
    """A family serving a variant of Wan's `WanPipeline` folder (Wan2.2 A14B's two experts, TI2V-5B's
    `expand_timesteps`): its own folder's code and `fields` over Wan's record, Wan's LoRA layout (the same
    transformer class), told apart by `variant` (model_index.json); renamed folders resolve to Wan."""
    checkpoint = dataclasses.replace(FAMILY.checkpoint, detect=None, variant=variant)
    return dataclasses.replace(
        FAMILY, name=name, checkpoint=checkpoint, code={"lora_original": FAMILY.lora_original}, **fields
    )
