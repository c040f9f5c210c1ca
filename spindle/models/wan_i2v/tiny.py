"""A tiny random Wan2.1 I2V pipeline in the diffusers layout (`spindle tiny-model wan_i2v`).

The Wan T2V tiny components (`spindle.models.wan.tiny`) plus what image-to-video adds: a CLIP vision
encoder with its image processor, and a transformer whose input carries the conditioning channels
(latents + 4 frame-mask channels + VAE-encoded conditioning video: 36 = 16 + 4 + 16 at real size)
with an image projection (`image_dim`) and the cross-attention's image key/value (`added_kv_proj_dim`).
"""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny import (
    Overrides,
    random_latent_stats,
    save_seeded_pipeline,
    seeded,
    t5_text_parts,
    update_model_index,
)
from spindle.models.wan.tiny import WAN_SCHEDULER, WAN_TEXT, WAN_TRANSFORMER, WAN_VAE

CLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,  # the pipeline takes the penultimate layer's hidden states
    num_attention_heads=4,
    image_size=32,
    patch_size=16,
)
MASK_CHANNELS = 4  # the frame mask: one channel per frame the VAE folds into a latent frame


def build_tiny_wan_i2v(
    out: str | Path,
    seed: int = 0,
    transformer: Overrides = None,
    vae: Overrides = None,
    text_encoder: Overrides = None,
    image_encoder: Overrides = None,
    clip: bool = True,
) -> Path:
    """Write a tiny random Wan2.1 I2V pipeline (`WanImageToVideoPipeline`) to `out` and return its path.
    Overrides are merged into the default component configs. `clip=False`: no image encoder and a
    transformer without the image projection (Wan2.2's I2V layout)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        UMT5Config,
        UMT5EncoderModel,
    )

    out = Path(out)
    vcfg = {**WAN_VAE, **(vae or {})}
    ecfg = {**WAN_TEXT, **(text_encoder or {})}
    icfg = {**CLIP_VISION, **(image_encoder or {})}
    z = vcfg["z_dim"]
    tcfg = {
        **WAN_TRANSFORMER,
        "in_channels": 2 * z + MASK_CHANNELS,
        "out_channels": z,
        "image_dim": icfg["hidden_size"] if clip else None,
        **(transformer or {}),
    }
    if clip:  # the cross-attention's image key/value project the image tokens to the attention width
        tcfg.setdefault("added_kv_proj_dim", tcfg["num_attention_heads"] * tcfg["attention_head_dim"])
    tcfg["text_dim"] = ecfg["d_model"]
    vcfg["latents_mean"], vcfg["latents_std"] = random_latent_stats(z, seed)

    tokenizer, text_config = t5_text_parts(out / "tokenizer", UMT5Config, ecfg)
    size = icfg["image_size"]
    save_seeded_pipeline(
        WanImageToVideoPipeline,
        out,
        seed,
        tokenizer=tokenizer,
        text_encoder=lambda: UMT5EncoderModel(text_config).eval(),
        vae=lambda: AutoencoderKLWan(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER),
        image_processor=(
            CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
            if clip
            else None
        ),
        image_encoder=seeded(seed + 3, lambda: CLIPVisionModel(CLIPVisionConfig(**icfg)).eval()) if clip else None,
        transformer=lambda: WanTransformer3DModel(**tcfg).eval(),
    )
    # Without torchvision transformers builds the PIL variant of CLIPImageProcessor, and the pipeline
    # records that class; real checkpoints name CLIPImageProcessor (which loads as the PIL one here).
    return update_model_index(out, **({"image_processor": ["transformers", "CLIPImageProcessor"]} if clip else {}))
