"""A tiny random Wan2.2 TI2V-5B pipeline in the diffusers layout (`spindle tiny-model wan22_ti2v`): the tiny
Wan components with the Wan2.2 VAE's shape (residual blocks, 2x2 pixel patches: 16x spatial compression, 12
pixel channels) and `expand_timesteps` in model_index.json, as Wan2.2-TI2V-5B-Diffusers has them."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny import Overrides, update_model_index
from spindle.models.wan.tiny import build_tiny as build_tiny_wan

# Wan2.2's VAE: base_dim 160, z_dim 48, is_residual, patch_size 2, in/out_channels 12 (= 3 x 2 x 2)
TI2V_VAE = dict(
    base_dim=8,
    z_dim=8,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=16,
)


def build_tiny(out: str | Path, seed: int = 0, transformer: Overrides = None, **overrides: dict | None) -> Path:
    """A tiny random Wan2.2 TI2V-5B pipeline (`WanPipeline` with `expand_timesteps`); overrides as
    `build_tiny_wan`'s (the transformer's channels follow the VAE's z_dim)."""
    z = TI2V_VAE["z_dim"]
    tcfg = {"in_channels": z, "out_channels": z, **(transformer or {})}
    vae = {**TI2V_VAE, **(overrides.pop("vae", None) or {})}
    return update_model_index(build_tiny_wan(out, seed, transformer=tcfg, vae=vae, **overrides), expand_timesteps=True)
