"""LoRA adapters with random weights for tests: the family's default targets (what `train.lora`
adapts), written in diffusers' layout through the family pipeline's own `save_lora_weights`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_lora_model(root: str | Path, seed: int, rank: int = 2, alpha: float = 4.0, std: float = 1.0) -> Any:
    """The transformer at `root` with PEFT adapters on the family's default targets, drawn N(0, std^2)
    from `seed`."""
    from spindle.config import LoraConfig
    from spindle.export.diffusers import load_transformer
    from spindle.train.tasks.flow_matching import add_lora

    model = add_lora(load_transformer(root), LoraConfig(rank=rank, alpha=alpha))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def random_lora(
    root: str | Path, seed: int, rank: int = 2, alpha: float = 4.0, std: float = 1.0
) -> dict[str, torch.Tensor]:
    """Adapters (diffusers layout, alpha / rank folded into lora_B) of `random_lora_model`."""
    from spindle.train.lora import adapter_state_dict, lora_scale

    model = random_lora_model(root, seed, rank, alpha, std)
    return adapter_state_dict(model.state_dict(), lora_scale(model))


def write_peft_folder(model: Any, out: str | Path) -> Path:
    """What PEFT's `PeftModel.save_pretrained` writes for `model`'s adapter: `adapter_model.safetensors`
    (`base_model.model.<module>.lora_A.weight`, alpha not folded) and `adapter_config.json`. -> `out`."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model)
    save_file(
        {f"base_model.model.{k}": v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors")
    )
    model.peft_config["default"].save_pretrained(str(out))
    return out


def write_lora(family: Any, adapters: dict[str, torch.Tensor], out: str | Path) -> Path:
    """`out/pytorch_lora_weights.safetensors` in diffusers' layout (the family pipeline writes it). -> `out`."""
    family.lora_pipeline_class().save_lora_weights(out, transformer_lora_layers=adapters)
    return Path(out)
