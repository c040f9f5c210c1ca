"""FLUX.1 text-to-image (diffusers `FluxPipeline` / `FluxTransformer2DModel`)."""

from pathlib import Path

from spindle.contracts.family import ConformanceSpec, DemoSpec, DiTFamily
from spindle.contracts.options import FamilyOptions, Option, needs_negative_prompt


def _looks_like_flux(root: Path) -> bool:
    """Renamed local folders: two text encoders (CLIP + T5) next to a Flux transformer config."""
    tcfg = root / "transformer" / "config.json"
    return tcfg.is_file() and '"pooled_projection_dim"' in tcfg.read_text() and (root / "text_encoder_2").is_dir()


# sampling options (CLI flags, HTTP fields); the family's inference spec declares the same object
OPTIONS = FamilyOptions(
    extra=(
        Option(
            "true_cfg_scale",
            float,
            default=1.0,  # FluxPipeline's default: no true CFG
            minimum=0.0,
            maximum=100.0,  # as guidance_scale (request.MAX_GUIDANCE): larger scales only blow latents up
            help="true classifier-free guidance scale, with a negative prompt",
            rule=needs_negative_prompt,
        ),
    ),
    guidance="embedded guidance of guidance-distilled checkpoints (FLUX.1-dev; ignored by schnell-style ones); "
    "CFG is true_cfg_scale",
)

FAMILY = DiTFamily(
    name="flux",
    pipeline_classes=("FluxPipeline",),
    transformer_classes=("FluxTransformer2DModel",),
    condition_model="spindle.models.flux.condition:FluxConditionModel",
    inference="spindle.models.flux.inference:FLUX_INFERENCE",
    tiny_model="spindle.models.flux.tiny:build_tiny_flux",
    lora_original="spindle.models.flux.lora:to_original",
    detect=_looks_like_flux,
    options=OPTIONS,
    demo=DemoSpec(
        dataset="spindle.data.synthetic:make_shapes_image_dataset",
        dataset_kwargs={"num_images": 16, "size": (32, 32)},
        sample_kwargs={"guidance_scale": 3.5},  # the embedded guidance the model was fine-tuned with
    ),
    conformance=ConformanceSpec(
        parity_cases={
            # Flux's guidance_scale is embedded guidance; classifier-free guidance is true_cfg_scale
            "cfg": dict(
                prompt="a red fox in the snow",
                negative_prompt="blurry",
                height=32,
                width=32,
                num_inference_steps=2,
                guidance_scale=3.5,
                true_cfg_scale=4.0,
                max_sequence_length=16,
                seed=7,
            ),
            "nocfg": dict(
                prompt="a red fox in the snow",
                height=32,
                width=48,
                num_inference_steps=3,
                guidance_scale=4.0,
                max_sequence_length=16,
                seed=0,
            ),
        },
        # default_sample_size 128 x the tiny VAE's factor 2
        default_params=dict(
            height=256,
            width=256,
            num_frames=None,
            num_inference_steps=28,
            guidance_scale=3.5,
            max_sequence_length=512,
            extra={"true_cfg_scale": 1.0},  # FluxPipeline's: no true CFG
        ),
        request_errors=(
            (
                dict(height=30),
                r"height must be a positive multiple of 4 for this model \(VAE x2 x 2x2 packing\) \(got 30\); "
                r"try 28 or 32",
            ),
            (dict(width=2), r"width must be a positive multiple of 4 .*\(got 2\); try 4"),
            (dict(max_sequence_length=513), r"max_sequence_length must be an integer between 1 and 512; got 513"),
        ),
        # the embedded --guidance flag
        cli_case=dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=3.5, seed=4),
    ),
)
