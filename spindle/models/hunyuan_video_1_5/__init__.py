"""HunyuanVideo-1.5 text-to-video (diffusers `HunyuanVideo15Pipeline` / `HunyuanVideo15Transformer3DModel`)."""

from pathlib import Path

from spindle.contracts.family import DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl

# the pipeline pads every prompt to 1000 Qwen2.5-VL tokens (its `tokenizer_max_length`); Spindle encodes at most that
MAX_SEQUENCE_LENGTH = 1000


def _looks_like_hyv15(root: Path) -> bool:
    """Renamed local folders: HunyuanVideo-1.5's VAE class."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLHunyuanVideo15"')


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object. 24 fps video
# (121 frames: 5 s); the VAE compresses time 4x, so num_frames = 4k + 1
OPTIONS = FamilyOptions(
    guidance="classifier-free guidance scale (default: the checkpoint's guider; 1 disables CFG)",
    fps=24,
    frame_multiple=4,
)

FAMILY = DiTFamily(
    name="hunyuan_video_1_5",
    # HunyuanVideo15Pipeline has no LoRA loader: its LoRA files are diffusers' HunyuanVideo layout ("transformer."
    # keys), which the stock transformer's `load_lora_adapter(path, prefix="transformer")` loads
    checkpoint=DiffusersCheckpoint(
        "HunyuanVideo15Pipeline",
        "HunyuanVideo15Transformer3DModel",
        detect=_looks_like_hyv15,
        lora_loader="HunyuanVideoLoraLoaderMixin",
    ),
    options=OPTIONS,
    demo=decl.demo(decl.VIDEO_DEMO),
)
