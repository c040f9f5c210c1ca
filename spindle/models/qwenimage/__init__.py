"""Qwen-Image text-to-image (diffusers `QwenImagePipeline` / `QwenImageTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DemoSpec, DiTFamily
from spindle.contracts.options import FamilyOptions, Option, needs_negative_prompt


def _looks_like_qwenimage(root: Path) -> bool:
    """Renamed local folders: a Qwen2.5-VL text encoder next to a Qwen-Image VAE."""
    vae_cfg = root / "vae" / "config.json"
    return vae_cfg.is_file() and '"AutoencoderKLQwenImage"' in vae_cfg.read_text()


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(
    extra=(
        Option(
            "true_cfg_scale",
            float,
            default=4.0,  # QwenImagePipeline's default: CFG runs once a negative_prompt is given
            minimum=0.0,
            maximum=100.0,  # as guidance_scale (request.MAX_GUIDANCE): larger scales only blow latents up
            help="true classifier-free guidance scale, with a negative prompt",
            rule=needs_negative_prompt,
        ),
    ),
    guidance="embedded guidance of guidance-distilled variants (ignored by Qwen-Image itself); CFG is true_cfg_scale",
)

FAMILY = DiTFamily(
    name="qwenimage",
    pipeline_classes=("QwenImagePipeline",),
    transformer_classes=("QwenImageTransformer2DModel",),
    condition_model="spindle.models.qwenimage.condition:QwenImageConditionModel",
    inference="spindle.models.qwenimage.inference:QWENIMAGE_INFERENCE",
    tiny_model="spindle.models.qwenimage.tiny:build_tiny_qwenimage",
    detect=_looks_like_qwenimage,
    options=OPTIONS,
    demo=DemoSpec(
        dataset="spindle.data.synthetic:make_shapes_image_dataset",
        dataset_kwargs={"num_images": 16, "size": (32, 32)},
        sample_kwargs={"negative_prompt": "", "true_cfg_scale": 4.0},
    ),
    conformance=ConformanceSpec(
        parity_cases={
            # classifier-free guidance is true_cfg_scale with a negative prompt (here longer than the
            # prompt: variable-length text, padded with a mask when CFG is batched)
            "cfg": dict(
                prompt="a red fox in the snow",
                negative_prompt="blurry low quality picture of a fox",
                true_cfg_scale=4.0,
                height=32,
                width=32,
                num_inference_steps=2,
                seed=7,
            ),
            "nocfg": dict(prompt="a red fox in the snow", height=32, width=48, num_inference_steps=3, seed=0),
        },
        # both layouts: the joint attention's text-padding mask goes through ring attention chunk by chunk
        # (spindle.distributed.context_parallel, key masks under ring attention)
        sequence_parallel=("ulysses2", "ring2"),
        # default_sample_size 128 x the tiny VAE's factor 2
        default_params=dict(
            height=256,
            width=256,
            negative_prompt=None,
            num_inference_steps=50,
            max_sequence_length=512,
            extra={"true_cfg_scale": 4.0},  # QwenImagePipeline's, which runs only with a negative prompt
        ),
        request_errors=(
            (
                dict(height=34),
                r"height must be a positive multiple of 4 for this model \(VAE x2 x 2x2 packing\) .*try 32 or 36",
            ),
            (dict(num_inference_steps=1), r"num_inference_steps must be >= 2 for this checkpoint's scheduler"),
            (dict(max_sequence_length=1025), r"max_sequence_length must be an integer between 1 and 1024; got 1025"),
        ),
        # the --true-cfg-scale flag
        cli_case=dict(
            prompt="a fox",
            negative_prompt="blurry",
            true_cfg_scale=2.5,
            height=32,
            width=48,
            num_inference_steps=2,
            seed=4,
        ),
    ),
)
