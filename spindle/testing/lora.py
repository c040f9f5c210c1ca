"""LoRA adapters with random weights for tests: the family's default targets (what `train.lora`
adapts), written in diffusers' layout through the family pipeline's own `save_lora_weights`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_lora(
    root: str | Path, seed: int, rank: int = 2, alpha: float = 4.0, std: float = 1.0
) -> dict[str, torch.Tensor]:
    """Adapters (diffusers layout, alpha / rank folded into lora_B) of the transformer at `root`, drawn
    N(0, std^2) from `seed`."""
    from spindle.config import LoraConfig
    from spindle.train.lora import adapter_state_dict, lora_scale
    from spindle.train.tasks.flow_matching import add_lora, load_transformer

    model = add_lora(load_transformer(root), LoraConfig(rank=rank, alpha=alpha))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return adapter_state_dict(model.state_dict(), lora_scale(model))


def write_lora(family: Any, adapters: dict[str, torch.Tensor], out: str | Path) -> Path:
    """`out/pytorch_lora_weights.safetensors` in diffusers' layout (the family pipeline writes it). -> `out`."""
    family.pipeline_class().save_lora_weights(out, transformer_lora_layers=adapters)
    return Path(out)
