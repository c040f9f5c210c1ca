"""A tiny random HunyuanVideo-1.5 I2V pipeline in the diffusers layout (`spindle tiny-model hunyuan_video_1_5_i2v`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.hunyuan_video_1_5.tiny import HYV15_TRANSFORMER, save_hyv15_pipeline
from spindle.models.shared.tiny import Overrides, update_model_index

# a SigLIP vision tower as wide as the transformer's image embedder: (32 / 8)^2 = 16 image tokens
SIGLIP_VISION = dict(
    hidden_size=HYV15_TRANSFORMER["image_embed_dim"],
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random HunyuanVideo-1.5 I2V pipeline (`HunyuanVideo15ImageToVideoPipeline`) to `out`.

    The text-to-video checkpoint's components (`spindle.models.hunyuan_video_1_5.tiny`) with an i2v transformer,
    plus a seeded `SiglipVisionModel` and its `SiglipImageProcessor` (32x32). Overrides as the T2V builder's.
    """
    import torch
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed + 3)
    image_encoder = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_VISION)).eval()
    processor = SiglipImageProcessor(size={"height": SIGLIP_VISION["image_size"], "width": SIGLIP_VISION["image_size"]})
    root = save_hyv15_pipeline(
        HunyuanVideo15ImageToVideoPipeline,
        Path(out),
        seed,
        "i2v",
        overrides,
        image_encoder=image_encoder,
        feature_extractor=processor,
    )
    # the class real checkpoints name (transformers builds it here as its PIL fallback, without torchvision)
    return update_model_index(root, feature_extractor=["transformers", "SiglipImageProcessor"])
