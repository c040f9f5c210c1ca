"""Flow-matching math of DiT training: how sigmas are drawn, shifted, and how the noisy input and the
velocity target are built. Families' condition models call these (`training_inputs`); every random draw
goes through the per-sample generators the training task passes in.

Shared numerics (spindle/ops imports nothing above it): the families and the training task both import
this module, and neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class TimestepSampling(Protocol):
    """How sigmas are drawn: the job's `train.timestep` (`spindle.config.TimestepConfig`, which is checked
    there; a protocol so that ops imports no config)."""

    @property
    def scheme(self) -> str: ...
    @property
    def logit_mean(self) -> float: ...
    @property
    def logit_std(self) -> float: ...
    @property
    def mode_scale(self) -> float: ...
    @property
    def shift(self) -> float: ...


def sample_sigmas(
    cfg: TimestepSampling,
    generators: list[torch.Generator],
    shift_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    within: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """One sigma per sample (`cfg`: the job's `train.timestep`; its `scheme` is checked by the config), each drawn from that sample's own generator (see `flow_matching_pair`).

    `shift_fn`: the family's own shift of the drawn sigmas (e.g. Flux's resolution-dependent shift,
    `resolution_shift`); it applies only while the static `cfg.shift` is 1 (an explicit static
    shift in the training config takes precedence). `within`: the range the shifted sigmas are mapped
    onto linearly (a two-expert model's trained expert).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    u = torch.cat(
        [
            compute_density_for_timestep_sampling(
                weighting_scheme=cfg.scheme,
                batch_size=1,
                logit_mean=cfg.logit_mean,
                logit_std=cfg.logit_std,
                mode_scale=cfg.mode_scale,
                generator=g,
            )
            for g in generators
        ]
    ).clamp(0.0, 1.0)
    sigmas = shift_fn(u) if shift_fn is not None and cfg.shift == 1.0 else shift_sigmas(u, cfg.shift)
    low, high = within
    if (low, high) == (0.0, 1.0):
        return sigmas
    # a two-expert model's expert (`ConditionModel.sigma_range`): the drawn density mapped onto its range
    return low + (high - low) * sigmas


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_matching_pair(
    x0: torch.Tensor, sigmas: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified flow: x_t = (1 - s) x0 + s * noise, velocity target = noise - x0.

    Noise comes from one CPU generator per sample, so a sample gets the same noise whichever rank or
    micro-batch it lands on: data-parallel and resumed runs reproduce single-process runs exactly.
    """
    from diffusers.utils.torch_utils import randn_tensor

    noise = randn_tensor(tuple(x0.shape), generator=generators, dtype=torch.float32).to(x0.device, x0.dtype)
    s = sigmas.to(x0.device, x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0 + s * noise, noise - x0
