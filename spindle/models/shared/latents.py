"""Latent statistics and schedule shifts that several families share, in training and inference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def resolution_shift(scheduler: Any, image_seq_len: int) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
    """Resolution-dependent ("dynamic") shift of a flow-matching scheduler with `use_dynamic_shifting`:
    -> (mu, sigma -> shifted sigma). `mu` is diffusers' `calculate_shift` of the image token count
    between the scheduler config's base/max sequence lengths and shifts (what FluxPipeline passes to
    `set_timesteps`); the shift is the scheduler's own `time_shift`, so training draws sigmas from
    the distribution the sampler walks at this resolution."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    return mu, lambda sigmas: scheduler.time_shift(mu, 1.0, sigmas)


def latent_stats(vae_config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel latent (mean, std) of a Wan-style 3-D VAE (Wan, Qwen-Image), shaped [1, C, 1, 1, 1]:
    training normalizes with them, inference decoding undoes them."""
    shape = (1, vae_config.z_dim, 1, 1, 1)
    return torch.tensor(vae_config.latents_mean).view(shape), torch.tensor(vae_config.latents_std).view(shape)


def mean_std_scale_shift(vae: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`InferenceSpec.decode_scale_shift` for mean/std VAEs: exactly diffusers' arithmetic,
    `latents / (1 / std) + mean`."""
    mean, std = (x.to(latents.device, latents.dtype) for x in latent_stats(vae.config))
    return 1.0 / std, mean
