"""A tiny random HunyuanVideo-1.5 pipeline in the diffusers layout (`spindle tiny-model hunyuan_video_1_5`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.models.shared.tiny import Overrides, component_overrides, save_seeded_pipeline
from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, save_llm_tokenizer

HYV15_TRANSFORMER = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    patch_size=1,
    patch_size_t=1,
    rope_axes_dim=(4, 6, 6),  # sums to the head dim
    image_embed_dim=16,  # the SigLIP width (an I2V checkpoint's image encoder; T2V feeds zeros of it)
    target_size=64,  # the pipeline's default size (pixels, about a side): 64 keeps the CPU default run small
)
# the real VAE's x16 spatial / x4 temporal compression (the pipeline reads both), at a few channels
HYV15_VAE = dict(latent_channels=4, block_out_channels=(8, 8, 16, 16, 16), layers_per_block=1, scaling_factor=0.7)
# Qwen2.5-VL text model (HunyuanVideo15Pipeline reads the third-to-last hidden state); the pipeline pads every
# prompt to 1000 tokens after its 108-token template prefix, so the table covers 1108 positions
HYV15_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
)
# ByT5 (the glyph encoder of quoted text in the prompt)
HYV15_GLYPH = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, relative_attention_num_buckets=8)
# the 480p T2V checkpoint's scheduler (static shift 5) and guider (CFG 6)
HYV15_SCHEDULER = dict(num_train_timesteps=1000, shift=5.0)
HYV15_GUIDANCE = 6.0


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random HunyuanVideo-1.5 T2V pipeline (`HunyuanVideo15Pipeline` layout) to `out`; return its path.

    A Qwen2.5-VL text model (`Qwen2_5_VLTextModel`, as the real checkpoint) with a chat-template tokenizer built
    locally, a ByT5 glyph encoder (`T5EncoderModel` + the byte-level `ByT5Tokenizer`),
    `AutoencoderKLHunyuanVideo15`, `HunyuanVideo15Transformer3DModel` (its channels: latents, the
    condition latents and the mask), the shift-5 scheduler and the CFG guider. Overrides merge into the
    defaults (`text_encoder`: the Qwen2.5-VL text config).
    """
    from diffusers import HunyuanVideo15Pipeline

    return save_hyv15_pipeline(HunyuanVideo15Pipeline, Path(out), seed, "t2v", overrides)


def save_hyv15_pipeline(
    pipeline_cls: Any, out: Path, seed: int, task: str, overrides: dict[str, Overrides], **parts: Any
) -> Path:
    """`pipeline_cls` (HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline; `task` the transformer's
    task_type) of the tiny components, + `parts` (an image encoder), saved to `out`."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        Qwen2TokenizerFast,
        T5Config,
        T5EncoderModel,
    )

    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    vcfg = {**HYV15_VAE, **vae}
    ecfg = {**HYV15_TEXT, **text_encoder}
    save_llm_tokenizer(out / "tokenizer", QWEN3_TOKENIZER, model_max_length=ecfg["max_position_embeddings"])
    tokenizer = Qwen2TokenizerFast.from_pretrained(out / "tokenizer")
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    text_config = Qwen2_5_VLTextConfig(**ids, bos_token_id=None, **ecfg)  # (Qwen's default bos is past this vocabulary)
    tokenizer_2 = ByT5Tokenizer()
    glyph_config = T5Config(vocab_size=len(tokenizer_2), pad_token_id=0, eos_token_id=1, **HYV15_GLYPH)
    channels = vcfg["latent_channels"]
    tcfg = {
        **HYV15_TRANSFORMER,
        "in_channels": 2 * channels + 1,  # noisy latents, condition latents, condition mask
        "out_channels": channels,
        "text_embed_dim": ecfg["hidden_size"],
        "text_embed_2_dim": glyph_config.d_model,
        "task_type": task,
        **transformer,
    }
    return save_seeded_pipeline(
        pipeline_cls,
        out,
        seed,
        tokenizer=tokenizer,
        text_encoder=lambda: Qwen2_5_VLTextModel(text_config).eval(),
        tokenizer_2=tokenizer_2,
        text_encoder_2=T5EncoderModel(glyph_config).eval(),
        vae=lambda: AutoencoderKLHunyuanVideo15(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**HYV15_SCHEDULER),
        guider=ClassifierFreeGuidance(guidance_scale=HYV15_GUIDANCE),
        transformer=lambda: HunyuanVideo15Transformer3DModel(**tcfg).eval(),
        **parts,
    )
