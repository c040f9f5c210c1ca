"""HunyuanVideo-1.5 image-to-video (diffusers `HunyuanVideo15ImageToVideoPipeline` around the same
`HunyuanVideo15Transformer3DModel`): the text-to-video family plus a conditioning first frame, through the SigLIP
image encoder and the VAE-encoded first frame with its frame mask. The video's size is the image's bucket (the
pipeline takes no height or width)."""

import dataclasses
from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.models.hunyuan_video_1_5 import FAMILY as T2V
from spindle.models.hunyuan_video_1_5 import OPTIONS as T2V_OPTIONS
from spindle.models.shared import declarations as decl

OPTIONS = dataclasses.replace(T2V_OPTIONS, images=(1, 1))  # the first frame, as the request's image


def _looks_like_hyv15_i2v(root: Path) -> bool:
    """Renamed local folders: HunyuanVideo-1.5's VAE next to a SigLIP image encoder."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLHunyuanVideo15"') and (root / "image_encoder").is_dir()


FAMILY = DiTFamily(
    name="hunyuan_video_1_5_i2v",
    # HunyuanVideo15Transformer3DModel is hunyuan_video_1_5's too: the pipeline class decides (spindle.registry)
    checkpoint=dataclasses.replace(
        T2V.checkpoint, pipeline="HunyuanVideo15ImageToVideoPipeline", detect=_looks_like_hyv15_i2v
    ),
    options=OPTIONS,
    demo=decl.demo(decl.VIDEO_DEMO),
)
assert isinstance(FAMILY.checkpoint, DiffusersCheckpoint)
