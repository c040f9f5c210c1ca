"""A tiny random FLUX.1-dev style pipeline in the diffusers layout (`spindle tiny-model flux`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny import (
    Overrides,
    component_overrides,
    dynamic_shift_scheduler,
    save_seeded_pipeline,
    seeded,
    t5_text_parts,
)
from spindle.models.shared.tokenizers import save_tokenizer

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
CLIP_MAX_LENGTH = 77  # CLIP's text positions (its tokenizer's model_max_length too)
FLUX_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=CLIP_MAX_LENGTH,
    projection_dim=32,
    hidden_act="quick_gelu",
)
FLUX_T5 = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8)
# FLUX.1-dev's scheduler config: resolution-dependent ("dynamic") shift between base and max.
FLUX_SCHEDULER = dynamic_shift_scheduler(shift=3.0, max_shift=1.15, max_image_seq_len=4096)


def build_tiny(out: str | Path, seed: int = 0, pipeline: str = "FluxPipeline", **overrides: Overrides) -> Path:
    """Write a tiny random FLUX.1 pipeline (`FluxPipeline` layout) to `out` and return its path.

    CLIP (pooled) + T5 text encoders with locally built tokenizers, `AutoencoderKL` with Flux's
    shift/scale, `FluxTransformer2DModel`, the dynamic-shift flow-matching scheduler. Overrides merge
    into the defaults (`text_encoder`: CLIP, `text_encoder_2`: T5); the transformer's text widths
    and input channels follow the encoders and the VAE. `pipeline`: the diffusers pipeline class saved
    around the same components (FLUX.1 Kontext: "FluxKontextPipeline").
    """
    import diffusers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    out = Path(out)
    transformer, vae, text_encoder, text_encoder_2 = component_overrides(
        overrides, "transformer", "vae", "text_encoder", "text_encoder_2"
    )
    tcfg = {**FLUX_TRANSFORMER, **transformer}
    vcfg = {**FLUX_VAE, **vae}
    depth = len(vcfg["block_out_channels"])  # VAE factor 2 ** (depth - 1); block types follow the depth
    vcfg["down_block_types"] = tuple(vcfg["down_block_types"][:1]) * depth
    vcfg["up_block_types"] = tuple(vcfg["up_block_types"][:1]) * depth
    ccfg = {**FLUX_CLIP, **text_encoder}
    ecfg = {**FLUX_T5, **text_encoder_2}
    if tcfg["in_channels"] % 4:
        raise ValueError(f"Flux in_channels must be 4 x VAE latent channels (2x2 packing); got {tcfg['in_channels']}")
    vcfg["latent_channels"] = tcfg["in_channels"] // 4
    tcfg["joint_attention_dim"] = ecfg["d_model"]
    tcfg["pooled_projection_dim"] = ccfg["hidden_size"]

    clip_vocab = save_tokenizer(out / "tokenizer", model_max_length=CLIP_MAX_LENGTH, bos_token="<s>")
    clip_config = CLIPTextConfig(vocab_size=clip_vocab, pad_token_id=0, eos_token_id=1, bos_token_id=3, **ccfg)
    tokenizer_2, t5_config = t5_text_parts(out / "tokenizer_2", T5Config, ecfg)
    return save_seeded_pipeline(
        getattr(diffusers, pipeline),
        out,
        seed,
        tokenizer=PreTrainedTokenizerFast.from_pretrained(out / "tokenizer"),
        tokenizer_2=tokenizer_2,
        text_encoder=lambda: CLIPTextModel(clip_config).eval(),
        text_encoder_2=seeded(seed + 3, lambda: T5EncoderModel(t5_config).eval()),
        vae=lambda: AutoencoderKL(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        transformer=lambda: FluxTransformer2DModel(**tcfg).eval(),
    )
