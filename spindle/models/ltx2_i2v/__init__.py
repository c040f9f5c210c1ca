"""LTX-2 image-to-video with its audio track (diffusers `LTX2ImageToVideoPipeline` around the same
`LTX2VideoTransformer3DModel`): the text-to-video family plus a conditioning first frame, VAE-encoded into the first
latent frame, which stays clean (timestep 0) while the rest is denoised."""

import dataclasses
from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import Option
from spindle.models.ltx2 import FAMILY as T2V
from spindle.models.ltx2 import OPTIONS as T2V_OPTIONS
from spindle.models.ltx2 import PLAIN_CFG
from spindle.models.shared import declarations as decl

# LTX2ImageToVideoPipeline re-compresses the image as one H.264 frame at this CRF before encoding it (what the model
# was trained on; its `image_crf=None` resolves to 33 for LTX-2 / 2.3's Gemma 3 text encoder); 0 skips it
IMAGE_CRF = Option(
    "image_crf",
    int,
    default=33,
    minimum=0,
    maximum=51,
    help="H.264 CRF the conditioning image is re-compressed at before encoding (0: as given)",
)
OPTIONS = dataclasses.replace(T2V_OPTIONS, extra=(*T2V_OPTIONS.extra, IMAGE_CRF), images=(1, 1))


def _looks_like_ltx2_i2v(root: Path) -> bool:
    """Renamed local folders cannot tell image-to-video from text-to-video (the same components): never."""
    return False


FAMILY = DiTFamily(
    name="ltx2_i2v",
    # LTX2VideoTransformer3DModel is ltx2's too: the pipeline class decides (spindle.registry)
    checkpoint=dataclasses.replace(T2V.checkpoint, pipeline="LTX2ImageToVideoPipeline", detect=_looks_like_ltx2_i2v),
    options=OPTIONS,
    ring_attention_refused=T2V.ring_attention_refused,
    code={"lora_original": T2V.lora_original},  # the same transformer: LTX-2's original LoRA layout
    demo=decl.demo(
        decl.VIDEO_DEMO,
        size=(64, 64),
        sample_kwargs={**decl.VIDEO_DEMO.sample_kwargs, "audio_guidance_scale": 1.0, **PLAIN_CFG},
    ),
)
assert isinstance(FAMILY.checkpoint, DiffusersCheckpoint)
