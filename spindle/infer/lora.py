"""Apply a LoRA file to a loaded checkpoint at inference (`spindle generate/serve --lora PATH`).

The LoRA is loaded by the family's own diffusers pipeline class (`load_lora_weights`), built around
the engine's already-loaded components: diffusers' readers for every LoRA layout it knows (its own,
kohya / ComfyUI / the original model's layout) apply, and the result is exactly what stock
`<Pipeline>.load_lora_weights(PATH)` gives. Adapters stay unfused (PEFT layers), scaled by `scale`.
Adapters chosen per request (`spindle serve --lora-dir`) load through the same `load_adapter`
(`spindle.infer.adapters`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

ADAPTER = "spindle_lora"


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA .safetensors file, or a folder holding diffusers' `pytorch_lora_weights.safetensors`."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / "pytorch_lora_weights.safetensors"
    if not path.is_file():
        raise FileNotFoundError(
            f"LoRA {path} not found: pass a .safetensors file or a folder with pytorch_lora_weights.safetensors"
        )
    from spindle.weight_files import check_weight_files

    check_weight_files(path)
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def lora_pipeline(family: Any, components: dict[str, Any]) -> Any:
    """The family's diffusers pipeline around the engine's loaded components (no copy of any weight):
    what diffusers' LoRA loading and adapter switching (`set_adapters`, `delete_adapters`) run on."""
    cls = family.pipeline_class()
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{name: components.get(name) for name in accepted if name != "self" and name in components})


def load_adapter(family: Any, pipe: Any, transformer: Any, path: str | Path, adapter_name: str) -> dict[str, str]:
    """Load the LoRA at `path` into `pipe`'s components as the PEFT adapter `adapter_name` (unmerged).
    -> the file's metadata. A file for another family or model size raises `ValueError` naming it."""
    from peft.tuners.lora import LoraLayer

    state_dict, metadata = read_lora_file(path)
    trained_for = metadata.get("family")
    if trained_for and trained_for != family.name:
        raise ValueError(f"LoRA {path} was trained for the {trained_for!r} family; this model is {family.name!r}")
    try:
        pipe.load_lora_weights(state_dict, adapter_name=adapter_name)
    except (ValueError, KeyError, RuntimeError, AssertionError, IndexError) as e:
        detail = str(e) if len(str(e)) < 600 else str(e)[:600] + " ..."  # size mismatches list every tensor
        raise ValueError(
            f"LoRA {path} does not fit this {family.name} checkpoint ({type(transformer).__name__}): {detail} "
            f"(is it a LoRA for another model family or model size?)"
        ) from None
    if not any(isinstance(m, LoraLayer) and adapter_name in m.lora_A for m in transformer.modules()):
        raise ValueError(
            f"LoRA {path} has no key for any module of this {family.name} checkpoint's {type(transformer).__name__}; "
            f"is it a LoRA for another model family? (first keys: {', '.join(list(state_dict)[:3])})"
        )
    return metadata


def apply_lora_file(family: Any, components: dict[str, Any], path: str | Path, scale: float = 1.0) -> None:
    """Load the LoRA at `path` into `components["transformer"]` (in place) with weight `scale`."""
    pipe = lora_pipeline(family, components)
    transformer = components["transformer"]
    load_adapter(family, pipe, transformer, path, ADAPTER)
    if scale != 1.0:
        pipe.set_adapters([ADAPTER], adapter_weights=[float(scale)])
    transformer.requires_grad_(False)
