"""A tiny random Z-Image pipeline in the diffusers layout (`spindle tiny-model z_image`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.flux.tiny import FLUX_VAE  # Z-Image decodes with the FLUX.1 VAE (its scale and shift)
from spindle.models.shared.tiny import Overrides, component_overrides, save_seeded_pipeline
from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, save_llm_tokenizer

Z_IMAGE_TRANSFORMER = dict(
    in_channels=4,  # the VAE's latent channels (the transformer patchifies 2x2 itself)
    dim=64,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=4,
    n_kv_heads=4,
    axes_dims=[4, 6, 6],  # sums to the head dim (dim / n_heads)
)
# the real VAE's x8 downsampling (4 blocks): ZImagePipeline's default 1024x1024 is then 64x64 patches, which
# the CPU warm-up of `spindle serve` runs in seconds (x2 would be 256x256 patches)
Z_IMAGE_VAE = dict(
    FLUX_VAE,
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
)
# Qwen3 text model (ZImagePipeline reads the second-to-last hidden state)
Z_IMAGE_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=1024,
)
# Z-Image-Turbo's scheduler config (the distilled model): a static shift of 3
Z_IMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random Z-Image pipeline (`ZImagePipeline` layout) to `out`; return its path.

    A Qwen3 text encoder (`Qwen3Model`, the class the real checkpoint names) with a Qwen3 chat-template
    tokenizer built locally, the FLUX.1-style `AutoencoderKL` (x8, non-trivial scale/shift),
    `ZImageTransformer2DModel`, Z-Image-Turbo's static-shift scheduler. Overrides merge into the
    defaults (`text_encoder`: the Qwen3 config); the transformer's caption width and channels follow
    the encoder and the VAE.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    tcfg = {**Z_IMAGE_TRANSFORMER, **transformer}
    vcfg = {**Z_IMAGE_VAE, **vae, "latent_channels": tcfg["in_channels"]}
    ecfg = {**Z_IMAGE_TEXT, **text_encoder}
    tcfg["cap_feat_dim"] = ecfg["hidden_size"]
    save_llm_tokenizer(out / "tokenizer", QWEN3_TOKENIZER, model_max_length=ecfg["max_position_embeddings"])
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    text_config = Qwen3Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **ecfg,
    )
    return save_seeded_pipeline(
        ZImagePipeline,
        out,
        seed,
        tokenizer=tokenizer,
        text_encoder=lambda: Qwen3Model(text_config).eval(),
        vae=lambda: AutoencoderKL(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**Z_IMAGE_SCHEDULER),
        transformer=lambda: ZImageTransformer2DModel(**tcfg).eval(),
    )
