"""HunyuanVideo-1.5 text-to-video (diffusers `HunyuanVideo15Pipeline` / `HunyuanVideo15Transformer3DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
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
    conformance=ConformanceSpec(
        # guidance_scale is the stock pipeline's guider's (`stock_guider`); 16-pixel multiples (VAE x16)
        parity_cases=decl.parity_cases(
            cfg=dict(num_frames=5, guidance_scale=6.0, seed=0, prompt='a sign that says "open"'),
            nocfg=dict(num_frames=9, height=64, width=64, guidance_scale=1.0, seed=7),
        ),
        stock_guider=("guidance_scale",),
        # HunyuanVideo15Transformer3DModel has no `_cp_plan`, and it regroups each sample's text tokens (valid ones
        # first) in its forward, so a sequence split before the blocks has nothing to shard by
        sequence_parallel=(),
        # HunyuanVideo15Pipeline.__call__ defaults; the size is its 16:9 bucket at the transformer's target_size (the
        # tiny's 64: 48x80), guidance the checkpoint guider's (the tiny's 6)
        default_params=dict(
            height=48, width=80, num_frames=121, num_inference_steps=50, guidance_scale=6.0, max_sequence_length=1000
        ),
        stock_size=(48, 80),
        request_errors=(
            decl.multiple_error("height", 40, 16, "32 or 48"),
            decl.multiple_error("width", 24, 16, "16 or 32"),
            (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
            decl.text_length_error(MAX_SEQUENCE_LENGTH),
        ),
    ),
)
