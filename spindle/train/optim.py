"""Optimizer and learning-rate schedule built from the `train` config section."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from spindle.config import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    trainable = [p for p in params if p.requires_grad]
    # foreach is the fast path on CPU and CUDA and supports the DTensor params FSDP2 produces.
    return torch.optim.AdamW(
        trainable, lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=True
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
