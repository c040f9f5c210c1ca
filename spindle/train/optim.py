"""Optimizer and learning-rate schedule built from the `train` config section."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from spindle.config import TrainConfig


def fused_adamw_supported(params: list[torch.Tensor]) -> bool:
    """torch has a fused (single-kernel) AdamW for the device of every parameter (CPU and CUDA here)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    return bool(params) and all(p.device.type in devices and p.dtype.is_floating_point for p in params)


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    trainable: list[torch.Tensor] = [p for p in params if p.requires_grad]
    # fused: one kernel per parameter group for the whole update where the device has one (also for
    # FSDP2's DTensor params); foreach (multi-tensor) otherwise.
    fused = fused_adamw_supported(trainable)
    return torch.optim.AdamW(
        trainable,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=fused or None,
        foreach=None if fused else True,
    )


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier on cfg.lr for optimizer step `step` (0-based): linear warmup, then constant or cosine."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
