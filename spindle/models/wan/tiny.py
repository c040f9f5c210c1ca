"""A tiny random Wan2.1 T2V pipeline in the diffusers layout (`spindle tiny-model wan`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.models.shared.tiny import (
    Overrides,
    component_overrides,
    random_latent_stats,
    save_seeded_pipeline,
    t5_text_parts,
)

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


def build_tiny(out: str | Path, seed: int = 0, **overrides: Overrides) -> Path:
    """Write a tiny random Wan2.1 T2V pipeline to `out` and return its path.

    Overrides are merged into the default component configs, e.g. `transformer={"num_layers": 4}`.
    """
    from diffusers import WanPipeline

    out = Path(out)
    transformer, vae, text_encoder = component_overrides(overrides, "transformer", "vae", "text_encoder")
    tcfg = {**WAN_TRANSFORMER, **transformer}
    vcfg = {**WAN_VAE, **vae}
    ecfg = {**WAN_TEXT, **text_encoder}
    if tcfg["in_channels"] != vcfg["z_dim"]:
        vcfg["z_dim"] = tcfg["in_channels"]
    return save_wan_pipeline(WanPipeline, out, seed, tcfg, vcfg, ecfg)


def save_wan_pipeline(
    pipeline_cls: Any, out: Path, seed: int, tcfg: dict, vcfg: dict, ecfg: dict, **parts: Any
) -> Path:
    """`pipeline_cls` (WanPipeline, WanImageToVideoPipeline) of a seeded UMT5 text encoder (config `ecfg`, its
    tokenizer built locally), Wan VAE (`vcfg`, non-trivial latent mean/std), transformer (`tcfg`, reading the
    encoder's width) and Wan's scheduler (+ `parts`, e.g. an image encoder) saved to `out`."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tcfg = {**tcfg, "text_dim": ecfg["d_model"]}
    vcfg = dict(vcfg)
    vcfg["latents_mean"], vcfg["latents_std"] = random_latent_stats(vcfg["z_dim"], seed)
    tokenizer, text_config = t5_text_parts(out / "tokenizer", UMT5Config, ecfg)
    return save_seeded_pipeline(
        pipeline_cls,
        out,
        seed,
        tokenizer=tokenizer,
        text_encoder=lambda: UMT5EncoderModel(text_config).eval(),
        vae=lambda: AutoencoderKLWan(**vcfg).eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER),
        transformer=lambda: WanTransformer3DModel(**tcfg).eval(),
        **parts,
    )
