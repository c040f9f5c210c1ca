"""Qwen-Image text-to-image (diffusers `QwenImagePipeline` / `QwenImageTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DiffusersCheckpoint, DiTFamily
from spindle.contracts.options import FamilyOptions
from spindle.models.shared import declarations as decl


def _looks_like_qwenimage(root: Path) -> bool:
    """Renamed local folders: a Qwen2.5-VL text encoder next to a Qwen-Image VAE."""
    return decl.config_mentions(root, "vae", '"AutoencoderKLQwenImage"')


# the scheduler's terminal shift needs two steps
STEPS_ERROR = (dict(num_inference_steps=1), r"num_inference_steps must be >= 2 for this checkpoint's scheduler")
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
    conformance=ConformanceSpec(
        # classifier-free guidance is true_cfg_scale with a negative prompt (here longer than the
        # prompt: variable-length text, padded with a mask when CFG is batched)
        parity_cases=decl.parity_cases(
            cfg=dict(negative_prompt="blurry low quality picture of a fox", true_cfg_scale=4.0, seed=7),
            nocfg=dict(seed=0),
        ),
        # both layouts: the joint attention's text-padding mask goes through ring attention chunk by chunk
        # (spindle.distributed.context_parallel, key masks under ring attention)
        sequence_parallel=("ulysses2", "ring2"),
        # true_cfg_scale: QwenImagePipeline's, which runs only with a negative prompt
        default_params=decl.image_default_params(4.0, negative_prompt=None, num_inference_steps=50),
        request_errors=(
            decl.multiple_error("height", 34, 4, "32 or 36", why=decl.PACKING),
            STEPS_ERROR,
            decl.text_length_error(1024),
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
