"""A tiny random Qwen-Image pipeline in the diffusers layout (`spindle tiny-model qwenimage`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.models.shared.tiny import (
    Overrides,
    component_overrides,
    dynamic_shift_scheduler,
    random_latent_stats,
    save_seeded_pipeline,
)
from spindle.models.shared.tokenizers import save_qwen_prompt_tokenizer

QWENIMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=16,  # VAE z_dim x 2x2 packing
    out_channels=4,  # VAE z_dim
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
QWENIMAGE_VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 1],
    num_res_blocks=1,
    temperal_downsample=[False],  # one downsampling stage: x2 spatial (the real one: 3 stages, x8)
)
# Qwen2.5-VL text model (the part Qwen-Image reads) and a minimal vision tower (saved, never run).
QWENIMAGE_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # sums to head_dim / 2
)
QWENIMAGE_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, fullatt_block_indexes=[0])
# Qwen-Image's scheduler config: dynamic (resolution-dependent) shift with exponential time shift.
QWENIMAGE_SCHEDULER = dynamic_shift_scheduler(
    shift=1.0, max_shift=0.9, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"
)
QWEN_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
QWEN_PAD_TOKEN = "<|endoftext|>"
# the words of QwenImagePipeline's prompt template, so that its system prefix is real tokens
QWEN_TEMPLATE_WORDS = (
    "system user assistant describe image detailing color size texture quantity text spatial relationships "
    "objects background"
).split()


def qwenimage_configs(
    transformer: Overrides, vae: Overrides, text_encoder: Overrides, seed: int
) -> tuple[dict, dict, dict]:
    """The transformer, VAE and text-encoder configs of a tiny Qwen-Image-style pipeline: the defaults
    with the overrides merged in, the linked widths derived (transformer channels = 4 x z_dim, text
    width = the encoder's), non-trivial latent mean/std."""
    tcfg = {**QWENIMAGE_TRANSFORMER, **(transformer or {})}
    vcfg = {**QWENIMAGE_VAE, **(vae or {})}
    ecfg = {**QWENIMAGE_TEXT, **(text_encoder or {})}
    if tcfg["in_channels"] % 4:
        raise ValueError(f"Qwen-Image in_channels must be 4 x VAE z_dim (2x2 packing); got {tcfg['in_channels']}")
    vcfg["z_dim"] = tcfg["out_channels"] = tcfg["in_channels"] // 4
    vcfg["latents_mean"], vcfg["latents_std"] = random_latent_stats(vcfg["z_dim"], seed)
    tcfg["joint_attention_dim"] = ecfg["hidden_size"]
    return tcfg, vcfg, ecfg


def qwen_text_encoder_config(
    tokenizer: Any, vocab: int, ecfg: dict, vision: dict, vision_tokens: dict[str, int] | None = None
) -> Any:
    """The `Qwen2_5_VLConfig` of a tiny Qwen-Image text encoder: text config `ecfg` over the tokenizer's
    vocabulary and special ids, the vision tower `vision`. `vision_tokens` (image_token_id, ...): the
    tokenizer's vision placeholders (an edit model's prompts carry images); None puts them outside the
    vocabulary, where a text-only prompt never has them."""
    from transformers import Qwen2_5_VLConfig

    special = {name: tokenizer.convert_tokens_to_ids(name) for name in (*QWEN_CHAT_TOKENS, QWEN_PAD_TOKEN)}
    if vision_tokens is None:
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        vision_tokens = {name: vocab + i for i, name in enumerate(names)}
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab,
            bos_token_id=special[QWEN_PAD_TOKEN],
            eos_token_id=special["<|im_end|>"],
            pad_token_id=special[QWEN_PAD_TOKEN],
            **ecfg,
        ),
        vision_config=dict(out_hidden_size=ecfg["hidden_size"], **vision),
        **vision_tokens,
    )


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random Qwen-Image pipeline (`QwenImagePipeline` layout) to `out`; return its path.

    A Qwen2.5-VL text encoder (`Qwen2_5_VLForConditionalGeneration`, the class the pipeline loads)
    with a chat-template tokenizer built locally, `AutoencoderKLQwenImage` with non-trivial latent
    mean/std, `QwenImageTransformer2DModel`, the dynamic-shift scheduler. Overrides merge into the
    defaults (`text_encoder`: the text config); the transformer's text width, input and output
    channels follow the encoder and the VAE.
    """
    from diffusers import QwenImagePipeline
    from transformers import PreTrainedTokenizerFast

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    tcfg, vcfg, ecfg = qwenimage_configs(transformer, vae, text_encoder, seed)
    vocab = save_qwen_prompt_tokenizer(out / "tokenizer", QWEN_CHAT_TOKENS, QWEN_PAD_TOKEN, QWEN_TEMPLATE_WORDS)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    text_config = qwen_text_encoder_config(tokenizer, vocab, ecfg, QWENIMAGE_VISION)
    return save_qwenimage_pipeline(QwenImagePipeline, out, seed, tcfg, vcfg, text_config, tokenizer=tokenizer)


def save_qwenimage_pipeline(
    pipeline_cls: Any, out: Path, seed: int, tcfg: dict, vcfg: dict, text_config: Any, **parts: Any
) -> Path:
    """`pipeline_cls` of a seeded Qwen2.5-VL text encoder, Qwen-Image VAE, transformer and Qwen-Image's
    scheduler (+ `parts`, e.g. the tokenizer) saved to `out`."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    return save_seeded_pipeline(
        pipeline_cls,
        out,
        seed,
        text_encoder=lambda: Qwen2_5_VLForConditionalGeneration(text_config).eval(),
        vae=lambda: AutoencoderKLQwenImage(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER),
        transformer=lambda: QwenImageTransformer2DModel(**tcfg).eval(),
        **parts,
    )
