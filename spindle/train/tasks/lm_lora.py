"""LoRA for the language-model tasks (causal LM, VLM): adapters on the decoder layers' linear layers
(`spindle.train.lora`, the same injection as for DiTs), exported as a PEFT adapter folder that stock
`peft.PeftModel.from_pretrained(base, folder)` loads, and, with `export.merge_lora`, a merged
transformers folder that stock transformers loads on its own.

Export layout (`<out>/`): `lora/` = `adapter_model.safetensors` (PEFT's key names,
`base_model.model.<module>.lora_A.weight`) + `adapter_config.json` (alpha / rank folded into lora_B,
so the config says alpha = rank) + the tokenizer and processor files; `merged/` = the base model with
`W + B @ A` in every adapted module.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

LORA_DIR, MERGED_DIR = "lora", "merged"
PEFT_PREFIX = "base_model.model."


def peft_adapter_config(base: str | Path, adapters: dict[str, torch.Tensor]) -> Any:
    """PEFT's LoraConfig for `adapters` (scale folded: alpha = rank), targeting exactly their modules."""
    from peft import LoraConfig

    modules = sorted({k.rsplit(".lora_", 1)[0] for k in adapters})
    rank = int(next(v for k, v in adapters.items() if ".lora_A." in k).shape[0])
    return LoraConfig(
        r=rank,
        lora_alpha=rank,
        target_modules=modules,
        base_model_name_or_path=str(Path(base).resolve()),
    )


def merged_state(base_state: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights with every adapter folded in (`W + B @ A`; the scale is already in B)."""
    out = dict(base_state)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        module = key.rsplit(".lora_A.", 1)[0]
        b = adapters[f"{module}.lora_B.weight"]
        weight = f"{module}.weight"
        out[weight] = (base_state[weight].float() + b.float() @ a.float()).to(base_state[weight].dtype)
    return out


def export_lm_lora(
    model_cls: Any,
    base: str | Path,
    adapters: dict[str, torch.Tensor],
    out: str | Path,
    merge: bool,
    extra_files: tuple[str, ...] = (),
) -> Path:
    """One process: write `out/lora/` (PEFT folder) and, with `merge`, `out/merged/` (module docstring).

    `adapters`: `<module>.lora_A.weight` / `<module>.lora_B.weight` with alpha / rank folded into lora_B
    (`spindle.train.lora.adapter_state_dict`)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    base, out = Path(base), Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lora = tmp / LORA_DIR
    lora.mkdir(parents=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in adapters.items()}, lora / "adapter_model.safetensors")
    peft_adapter_config(base, adapters).save_pretrained(lora)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.save_pretrained(lora)
    for name in extra_files:
        if (base / name).is_file():
            shutil.copy2(base / name, lora / name)
    if merge:
        model = model_cls.from_pretrained(base, dtype="auto")
        model.load_state_dict(merged_state(model.state_dict(), adapters))
        model.save_pretrained(tmp / MERGED_DIR)
        tokenizer.save_pretrained(tmp / MERGED_DIR)
        for name in extra_files:
            if (base / name).is_file():
                shutil.copy2(base / name, tmp / MERGED_DIR / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
