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
    component_overrides,
    seeded,
    update_model_index,
)
from spindle.models.wan.tiny import WAN_TEXT, WAN_TRANSFORMER, WAN_VAE, save_wan_pipeline

CLIP_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,  # the pipeline takes the penultimate layer's hidden states
    num_attention_heads=4,
    image_size=32,
    patch_size=16,
)
MASK_CHANNELS = 4  # the frame mask: one channel per frame the VAE folds into a latent frame


def build_tiny(out: str | Path, seed: int = 0, clip: bool = True, **overrides: Overrides) -> Path:
    """Write a tiny random Wan2.1 I2V pipeline (`WanImageToVideoPipeline`) to `out` and return its path.
    Overrides are merged into the default component configs. `clip=False`: no image encoder and a
    transformer without the image projection (Wan2.2's I2V layout)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    out = Path(out)
    transformer, vae, text_encoder, image_encoder = component_overrides(
        overrides, "transformer", "vae", "text_encoder", "image_encoder"
    )
    vcfg = {**WAN_VAE, **vae}
    ecfg = {**WAN_TEXT, **text_encoder}
    icfg = {**CLIP_VISION, **image_encoder}
    z = vcfg["z_dim"]
    tcfg = {
        **WAN_TRANSFORMER,
        "in_channels": 2 * z + MASK_CHANNELS,
        "out_channels": z,
        "image_dim": icfg["hidden_size"] if clip else None,
        **transformer,
    }
    if clip:  # the cross-attention's image key/value project the image tokens to the attention width
        tcfg.setdefault("added_kv_proj_dim", tcfg["num_attention_heads"] * tcfg["attention_head_dim"])
    size = icfg["image_size"]
    save_wan_pipeline(
        WanImageToVideoPipeline,
        out,
        seed,
        tcfg,
        vcfg,
        ecfg,
        image_processor=(
            CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
            if clip
            else None
        ),
        image_encoder=seeded(seed + 3, lambda: CLIPVisionModel(CLIPVisionConfig(**icfg)).eval()) if clip else None,
    )
    # Without torchvision transformers builds the PIL variant of CLIPImageProcessor, and the pipeline
    # records that class; real checkpoints name CLIPImageProcessor (which loads as the PIL one here).
    return update_model_index(out, **({"image_processor": ["transformers", "CLIPImageProcessor"]} if clip else {}))
