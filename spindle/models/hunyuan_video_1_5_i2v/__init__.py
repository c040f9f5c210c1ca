"""HunyuanVideo-1.5 image-to-video (diffusers `HunyuanVideo15ImageToVideoPipeline` around the same
`HunyuanVideo15Transformer3DModel`): the text-to-video family plus a conditioning first frame, through the SigLIP
image encoder and the VAE-encoded first frame with its frame mask. The video's size is the image's bucket (the
pipeline takes no height or width)."""

import dataclasses
from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
from spindle.models.hunyuan_video_1_5 import FAMILY as T2V
from spindle.models.hunyuan_video_1_5 import MAX_SEQUENCE_LENGTH
from spindle.models.hunyuan_video_1_5 import OPTIONS as T2V_OPTIONS
from spindle.models.shared import declarations as decl
from spindle.models.shared.test_images import noise_image  # the suite's seeded conditioning image

OPTIONS = dataclasses.replace(T2V_OPTIONS, images=(1, 1))  # the first frame, as the request's image


def _looks_like_hyv15_i2v(root: Path) -> bool:
    """Renamed local folders: HunyuanVideo-1.5's VAE next to a SigLIP image encoder."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLHunyuanVideo15"') and (root / "image_encoder").is_dir()


# the stock pipeline's arguments: no height or width (the image's bucket at the transformer's target_size)
CASE = dict(prompt=decl.PROMPT, image=noise_image(40, 56))

assert T2V.conformance is not None
FAMILY = DiTFamily(
    name="hunyuan_video_1_5_i2v",
    # HunyuanVideo15Transformer3DModel is hunyuan_video_1_5's too: the pipeline class decides (spindle.registry)
    checkpoint=dataclasses.replace(
        T2V.checkpoint, pipeline="HunyuanVideo15ImageToVideoPipeline", detect=_looks_like_hyv15_i2v
    ),
    options=OPTIONS,
    demo=decl.demo(decl.VIDEO_DEMO),
    conformance=dataclasses.replace(
        T2V.conformance,
        parity_cases={
            "cfg": dict(
                CASE, negative_prompt="blurry", num_frames=5, num_inference_steps=2, guidance_scale=6.0, seed=0
            ),
            "nocfg": dict(CASE, num_frames=9, num_inference_steps=3, guidance_scale=1.0, seed=7),
        },
        # HunyuanVideo15ImageToVideoPipeline.__call__ defaults; the size follows the image
        default_params=dict(T2V.conformance.default_params, height=None, width=None),
        stock_size=None,
        request_errors=(
            (dict(height=64), r"height needs width too: give both"),
            (dict(height=40, width=64), r"height must be a positive multiple of 16"),
            (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
            decl.text_length_error(MAX_SEQUENCE_LENGTH),
        ),
    ),
)
assert isinstance(FAMILY.conformance, ConformanceSpec) and isinstance(FAMILY.checkpoint, DiffusersCheckpoint)
