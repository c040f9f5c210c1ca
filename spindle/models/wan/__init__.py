"""Wan2.1 text-to-video (diffusers `WanPipeline` / `WanTransformer3DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DemoSpec, DiTFamily
from spindle.contracts.options import FamilyOptions


def _looks_like_wan(root: Path) -> bool:
    """Renamed local folders: a UMT5 text encoder next to a Wan VAE is Wan."""
    vae_cfg = root / "vae" / "config.json"
    return vae_cfg.is_file() and '"AutoencoderKLWan"' in vae_cfg.read_text()


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
# Wan2.1 is trained on 16 fps video; its VAE compresses time 4x, so num_frames = 4k + 1
OPTIONS = FamilyOptions(fps=16, frame_multiple=4)

FAMILY = DiTFamily(
    name="wan",
    pipeline_classes=("WanPipeline",),
    transformer_classes=("WanTransformer3DModel",),
    condition_model="spindle.models.wan.condition:WanConditionModel",
    inference="spindle.models.wan.inference:WAN_INFERENCE",
    tiny_model="spindle.models.wan.tiny:build_tiny_wan",
    lora_original="spindle.models.wan.lora:to_original",
    detect=_looks_like_wan,
    options=OPTIONS,
    demo=DemoSpec(
        dataset="spindle.data.synthetic:make_shapes_video_dataset",
        dataset_kwargs={"num_videos": 16, "num_frames": 9, "size": (32, 32)},
        num_frames=9,
        sample_suffix=".mp4",
        sample_kwargs={"num_frames": 9, "guidance_scale": 1.0},
    ),
    conformance=ConformanceSpec(
        parity_cases={
            "cfg": dict(
                prompt="a red fox in the snow",
                negative_prompt="blurry",
                height=32,
                width=32,
                num_frames=5,
                num_inference_steps=2,
                guidance_scale=5.0,
                seed=0,
            ),
            "nocfg": dict(
                prompt="a red fox in the snow",
                height=32,
                width=48,
                num_frames=9,
                num_inference_steps=3,
                guidance_scale=1.0,
                seed=7,
            ),
        },
        request_errors=(
            (dict(height=30), r"height must be a positive multiple of 16 .*got 30.*try 16 or 32"),
            (dict(width=40), r"width must be a positive multiple of 16 .*got 40.*try 32 or 48"),
            (dict(height=0), r"height must be a positive multiple of 16"),
            (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
            (dict(num_frames=0), r"num_frames must be 4k\+1"),
        ),
        # WanPipeline's __call__ names its size
        default_params=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
    ),
)
