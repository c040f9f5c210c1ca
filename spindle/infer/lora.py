"""Apply a LoRA file to a loaded checkpoint at inference (`spindle generate/serve --lora PATH`).

The LoRA is loaded by the family's own diffusers pipeline class (`load_lora_weights`), built around
the engine's already-loaded components: diffusers' readers for every LoRA layout it knows (its own,
kohya / ComfyUI / the original model's layout) apply, and the result is exactly what stock
`<Pipeline>.load_lora_weights(PATH)` gives. Adapters stay unfused (PEFT layers), scaled by `scale`.
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


def apply_lora_file(family: Any, components: dict[str, Any], path: str | Path, scale: float = 1.0) -> None:
    """Load the LoRA at `path` into `components["transformer"]` (in place) with weight `scale`; a LoRA that
    Spindle trained for a two-expert checkpoint's `transformer_2` (its spindle.json says so) goes there, as
    stock `load_lora_weights(..., load_into_transformer_2=True)` puts it."""
    from peft.tuners.lora import LoraLayer

    from spindle.export_record import read_export_record

    state_dict, metadata = read_lora_file(path)
    component = read_export_record(path).get("component", "transformer")
    if component not in ("transformer", "transformer_2") or components.get(component) is None:
        raise ValueError(
            f"LoRA {path} was trained for the checkpoint's {component!r}, which this {family.name} checkpoint lacks"
        )
    into = {"load_into_transformer_2": True} if component == "transformer_2" else {}
    trained_for = metadata.get("family")
    if trained_for and trained_for != family.name:
        raise ValueError(f"LoRA {path} was trained for the {trained_for!r} family; this model is {family.name!r}")
    cls = family.pipeline_class()
    accepted = inspect.signature(cls.__init__).parameters
    pipe = cls(**{name: components.get(name) for name in accepted if name != "self" and name in components})
    transformer = components[component]
    try:
        pipe.load_lora_weights(state_dict, adapter_name=ADAPTER, **into)
    except (ValueError, KeyError, RuntimeError, AssertionError, IndexError) as e:
        detail = str(e) if len(str(e)) < 600 else str(e)[:600] + " ..."  # size mismatches list every tensor
        raise ValueError(
            f"LoRA {path} does not fit this {family.name} checkpoint ({type(transformer).__name__}): {detail} "
            f"(is it a LoRA for another model family or model size?)"
        ) from None
    if not any(isinstance(m, LoraLayer) for m in transformer.modules()):
        raise ValueError(
            f"LoRA {path} has no key for any module of this {family.name} checkpoint's {type(transformer).__name__}; "
            f"is it a LoRA for another model family? (first keys: {', '.join(list(state_dict)[:3])})"
        )
    if scale != 1.0:
        pipe.set_adapters([ADAPTER], adapter_weights=[float(scale)])
    transformer.requires_grad_(False)
