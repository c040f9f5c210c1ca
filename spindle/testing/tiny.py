"""Tiny random checkpoints in the exact diffusers pipeline layout.

No weights can be downloaded here, so tests, the demo and the benchmarks build their checkpoints
locally. What comes out is a normal diffusers folder (`model_index.json` + component subfolders):
the real loading code of Spindle and of stock diffusers is exercised on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spindle.testing.tokenizer import save_tokenizer

WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=128,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)
WAN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
WAN_TEXT = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
WAN_SCHEDULER = dict(shift=3.0, num_train_timesteps=1000)


def _latent_stats(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Non-trivial per-channel latent mean/std so that normalization bugs show up in tests."""
    g = torch.Generator().manual_seed(seed + 7)
    mean = (torch.rand(z_dim, generator=g) - 0.5).tolist()
    std = (0.5 + 1.5 * torch.rand(z_dim, generator=g)).tolist()
    return [round(x, 4) for x in mean], [round(x, 4) for x in std]


def _seeded(seed: int, build: Callable[[], Any]) -> Any:
    torch.manual_seed(seed)
    return build()


def build_tiny_wan(
    out: str | Path,
    seed: int = 0,
    transformer: dict | None = None,
    vae: dict | None = None,
    text_encoder: dict | None = None,
) -> Path:
    """Write a tiny random Wan2.1 T2V pipeline to `out` and return its path.

    Overrides are merged into the default component configs, e.g. `transformer={"num_layers": 4}`.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    out = Path(out)
    tcfg = {**WAN_TRANSFORMER, **(transformer or {})}
    vcfg = {**WAN_VAE, **(vae or {})}
    ecfg = {**WAN_TEXT, **(text_encoder or {})}
    if tcfg["in_channels"] != vcfg["z_dim"]:
        vcfg["z_dim"] = tcfg["in_channels"]
    tcfg["text_dim"] = ecfg["d_model"]
    vcfg["latents_mean"], vcfg["latents_std"] = _latent_stats(vcfg["z_dim"], seed)

    tok_dir = out / "tokenizer"
    vocab_size = save_tokenizer(tok_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    text_config = UMT5Config(vocab_size=vocab_size, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **ecfg)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(seed, lambda: UMT5EncoderModel(text_config).eval()),
        vae=_seeded(seed + 1, lambda: AutoencoderKLWan(**vcfg).eval()),
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER),
        transformer=_seeded(seed + 2, lambda: WanTransformer3DModel(**tcfg).eval()),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return out


FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,  # VAE latent channels x 2x2 packing
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    guidance_embeds=True,  # FLUX.1-dev style (embedded guidance); False for schnell style
    axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
)
FLUX_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),  # 2 blocks: x2 spatial compression
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=32,
    scaling_factor=0.3611,  # FLUX.1's values: non-trivial, so a missing shift/scale shows up in tests
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
FLUX_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    projection_dim=32,
    hidden_act="quick_gelu",
)
FLUX_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
# FLUX.1-dev's scheduler config: resolution-dependent ("dynamic") shift between base and max.
FLUX_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
CLIP_MAX_LENGTH = 77


def build_tiny_flux(
    out: str | Path,
    seed: int = 0,
    transformer: dict | None = None,
    vae: dict | None = None,
    text_encoder: dict | None = None,
    text_encoder_2: dict | None = None,
) -> Path:
    """Write a tiny random FLUX.1 pipeline (`FluxPipeline` layout) to `out` and return its path.

    CLIP (pooled) + T5 text encoders with locally built tokenizers, `AutoencoderKL` with Flux's
    shift/scale, `FluxTransformer2DModel`, the dynamic-shift flow-matching scheduler. Overrides merge
    into the defaults (`text_encoder`: CLIP, `text_encoder_2`: T5); the transformer's text widths
    and input channels follow the encoders and the VAE.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    out = Path(out)
    tcfg = {**FLUX_TRANSFORMER, **(transformer or {})}
    vcfg = {**FLUX_VAE, **(vae or {})}
    depth = len(vcfg["block_out_channels"])  # VAE factor 2 ** (depth - 1); block types follow the depth
    vcfg["down_block_types"] = tuple(vcfg["down_block_types"][:1]) * depth
    vcfg["up_block_types"] = tuple(vcfg["up_block_types"][:1]) * depth
    ccfg = {**FLUX_CLIP, **(text_encoder or {})}
    ecfg = {**FLUX_T5, **(text_encoder_2 or {})}
    if tcfg["in_channels"] % 4:
        raise ValueError(f"Flux in_channels must be 4 x VAE latent channels (2x2 packing); got {tcfg['in_channels']}")
    vcfg["latent_channels"] = tcfg["in_channels"] // 4
    tcfg["joint_attention_dim"] = ecfg["d_model"]
    tcfg["pooled_projection_dim"] = ccfg["hidden_size"]

    clip_vocab = save_tokenizer(out / "tokenizer", model_max_length=CLIP_MAX_LENGTH, bos_token="<s>")
    t5_vocab = save_tokenizer(out / "tokenizer_2")
    clip_config = CLIPTextConfig(vocab_size=clip_vocab, pad_token_id=0, eos_token_id=1, bos_token_id=3, **ccfg)
    t5_config = T5Config(vocab_size=t5_vocab, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **ecfg)
    pipe = FluxPipeline(
        tokenizer=PreTrainedTokenizerFast.from_pretrained(out / "tokenizer"),
        tokenizer_2=PreTrainedTokenizerFast.from_pretrained(out / "tokenizer_2"),
        text_encoder=_seeded(seed, lambda: CLIPTextModel(clip_config).eval()),
        text_encoder_2=_seeded(seed + 3, lambda: T5EncoderModel(t5_config).eval()),
        vae=_seeded(seed + 1, lambda: AutoencoderKL(**vcfg).eval()),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        transformer=_seeded(seed + 2, lambda: FluxTransformer2DModel(**tcfg).eval()),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return out


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
QWENIMAGE_SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)
QWEN_CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
QWEN_PAD_TOKEN = "<|endoftext|>"
# the words of QwenImagePipeline's prompt template, so that its system prefix is real tokens
QWEN_TEMPLATE_WORDS = (
    "system user assistant describe image detailing color size texture quantity text spatial relationships "
    "objects background"
).split()


def build_tiny_qwenimage(
    out: str | Path,
    seed: int = 0,
    transformer: dict | None = None,
    vae: dict | None = None,
    text_encoder: dict | None = None,
) -> Path:
    """Write a tiny random Qwen-Image pipeline (`QwenImagePipeline` layout) to `out`; return its path.

    A Qwen2.5-VL text encoder (`Qwen2_5_VLForConditionalGeneration`, the class the pipeline loads)
    with a chat-template tokenizer built locally, `AutoencoderKLQwenImage` with non-trivial latent
    mean/std, `QwenImageTransformer2DModel`, the dynamic-shift scheduler. Overrides merge into the
    defaults (`text_encoder`: the text config); the transformer's text width, input and output
    channels follow the encoder and the VAE.
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from spindle.testing.tokenizer import save_qwen_prompt_tokenizer

    out = Path(out)
    tcfg = {**QWENIMAGE_TRANSFORMER, **(transformer or {})}
    vcfg = {**QWENIMAGE_VAE, **(vae or {})}
    ecfg = {**QWENIMAGE_TEXT, **(text_encoder or {})}
    if tcfg["in_channels"] % 4:
        raise ValueError(f"Qwen-Image in_channels must be 4 x VAE z_dim (2x2 packing); got {tcfg['in_channels']}")
    vcfg["z_dim"] = tcfg["out_channels"] = tcfg["in_channels"] // 4
    vcfg["latents_mean"], vcfg["latents_std"] = _latent_stats(vcfg["z_dim"], seed)
    tcfg["joint_attention_dim"] = ecfg["hidden_size"]

    vocab = save_qwen_prompt_tokenizer(out / "tokenizer", QWEN_CHAT_TOKENS, QWEN_PAD_TOKEN, QWEN_TEMPLATE_WORDS)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "tokenizer")
    special = {name: tokenizer.convert_tokens_to_ids(name) for name in (*QWEN_CHAT_TOKENS, QWEN_PAD_TOKEN)}
    text_config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab,
            bos_token_id=special[QWEN_PAD_TOKEN],
            eos_token_id=special["<|im_end|>"],
            pad_token_id=special[QWEN_PAD_TOKEN],
            **ecfg,
        ),
        vision_config=dict(out_hidden_size=ecfg["hidden_size"], **QWENIMAGE_VISION),
        # vision placeholders outside the text vocabulary: a text-only prompt never contains them
        image_token_id=vocab,
        video_token_id=vocab + 1,
        vision_start_token_id=vocab + 2,
        vision_end_token_id=vocab + 3,
    )
    pipe = QwenImagePipeline(
        tokenizer=tokenizer,
        text_encoder=_seeded(seed, lambda: Qwen2_5_VLForConditionalGeneration(text_config).eval()),
        vae=_seeded(seed + 1, lambda: AutoencoderKLQwenImage(**vcfg).eval()),
        scheduler=FlowMatchEulerDiscreteScheduler(**QWENIMAGE_SCHEDULER),
        transformer=_seeded(seed + 2, lambda: QwenImageTransformer2DModel(**tcfg).eval()),
    )
    pipe.save_pretrained(out, safe_serialization=True)
    return out


TINY_BUILDERS: dict[str, Callable[..., Path]] = {
    "wan": build_tiny_wan,
    "flux": build_tiny_flux,
    "qwenimage": build_tiny_qwenimage,
}


def build_tiny(family: str, out: str | Path, seed: int = 0, **overrides: Any) -> Path:
    if family not in TINY_BUILDERS:
        raise ValueError(f"no tiny model for family {family!r}; choose one of {sorted(TINY_BUILDERS)}")
    return TINY_BUILDERS[family](out, seed=seed, **overrides)


def read_model_index(root: str | Path) -> dict:
    return json.loads((Path(root) / "model_index.json").read_text())
