"""Qwen-Image-Edit: instruction image editing on Qwen-Image (diffusers `QwenImageEditPipeline`; its
several-image variant `QwenImageEditPlusPipeline` is the `qwenimage_edit_plus` family, `plus.py`).

A `QwenImageTransformer2DModel` denoising the output's latents next to the input image's reference
latents (one token sequence), prompted by Qwen2.5-VL reading the instruction *with* the image. This
folder reuses Qwen-Image's stages, condition model and tiny parts (models/qwenimage) and adds the
input images: their sizing (`image_area`, `condition_image_area`), the vision-language prompt and the
reference latents. The checkpoint's `Qwen2VLProcessor` is assembled without torchvision (`processor.py`).
"""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions, Option
from spindle.models.qwenimage import OPTIONS as QWENIMAGE_OPTIONS
from spindle.models.shared.declarations import EDIT_DEMO, config_mentions, demo

# The pipelines' sizing of the input images: calculate_dimensions(area, aspect) -> sides, multiples of 32.
VAE_IMAGE_AREA = 1024 * 1024  # both pipelines: the image the VAE encodes (and the default output size)
CONDITION_IMAGE_AREA = 384 * 384  # QwenImageEditPlusPipeline: each image the text encoder sees
MAX_IMAGE_AREA = 2048 * 2048  # 4x the pipelines' area (and the server's default --max-pixels)


def _area(name: str, default: int, what: str) -> Option:
    return Option(
        name,
        int,
        default=default,
        minimum=32 * 32,
        maximum=MAX_IMAGE_AREA,
        pixels=True,
        help=f"pixels of each input image as {what} (aspect kept, sides multiples of 32; the pipeline's "
        f"{int(default**0.5)}x{int(default**0.5)})",
    )


IMAGE_AREA = _area("image_area", VAE_IMAGE_AREA, "the VAE encodes it, and of the output when no size is given")
OPTIONS = FamilyOptions(
    extra=(*QWENIMAGE_OPTIONS.extra, IMAGE_AREA),
    guidance=QWENIMAGE_OPTIONS.guidance,
    images=(1, 1),
)
MAX_PLUS_IMAGES = 3  # Qwen-Image-Edit-2509's model card: 1 to 3 input images
PLUS_OPTIONS = FamilyOptions(
    extra=(
        *OPTIONS.extra,
        _area("condition_image_area", CONDITION_IMAGE_AREA, "the vision-language text encoder sees it"),
    ),
    guidance=QWENIMAGE_OPTIONS.guidance,
    images=(1, MAX_PLUS_IMAGES),
)


def _looks_like_edit(root: Path) -> bool:
    """Renamed local folders: a Qwen-Image VAE next to a Qwen2-VL processor folder."""
    processor = root / "processor" / "preprocessor_config.json"
    return processor.is_file() and config_mentions(root, "vae", '"AutoencoderKLQwenImage"')


def text_tokens(images: int) -> int:
    """model.max_text_length of the tiny checks: the instruction plus each image's vision tokens (and
    "Picture N:" for several), within a multiple of the SP degrees."""
    return 32 if images == 1 else 48


DEMO = demo(EDIT_DEMO, sample_kwargs={"negative_prompt": "", "true_cfg_scale": 4.0}, text_tokens=text_tokens(1))

FAMILY = DiTFamily(
    name="qwenimage_edit",
    # QwenImageTransformer2DModel is qwenimage's too: the pipeline class decides (spindle.registry)
    checkpoint=DiffusersCheckpoint("QwenImageEditPipeline", "QwenImageTransformer2DModel", detect=_looks_like_edit),
    options=OPTIONS,
    demo=DEMO,
)
