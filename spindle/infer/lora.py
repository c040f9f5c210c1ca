"""Apply a LoRA file to a loaded checkpoint at inference (`spindle generate/serve --lora PATH`).

The LoRA is loaded by the family's own diffusers pipeline class (`load_lora_weights`), built around
the engine's already-loaded components: diffusers' readers for every LoRA layout it knows (its own,
kohya / ComfyUI / the original model's layout) apply, and the result is exactly what stock
`<Pipeline>.load_lora_weights(PATH)` gives; a PEFT adapter folder is read into diffusers' layout first. Adapters stay unfused (PEFT layers), scaled by `scale`.
Adapters chosen per request (`spindle serve --lora-dir`) load through the same `load_adapter`
(`spindle.infer.adapters`).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

ADAPTER = "spindle_lora"


PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA .safetensors file, a folder holding diffusers' `pytorch_lora_weights.safetensors`, or a
    PEFT adapter folder (`adapter_model.safetensors` + `adapter_config.json`, what PEFT's
    `save_pretrained` writes for the transformer; read by `peft_to_diffusers`)."""
    from safetensors import safe_open

    path, peft_config = lora_files(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"LoRA {path} not found: pass a .safetensors file, a folder with pytorch_lora_weights.safetensors or "
            f"a PEFT adapter folder ({PEFT_WEIGHTS} + {PEFT_CONFIG})"
        )
    from spindle.weight_files import check_weight_files

    check_weight_files(path)
    with safe_open(str(path), framework="pt") as f:
        state_dict, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    if peft_config is not None:
        state_dict = peft_to_diffusers(state_dict, peft_config)
    return state_dict, metadata


def lora_files(path: str | Path) -> tuple[Path, Path | None]:
    """The files `read_lora_file` reads for `path`: (the weights, the PEFT config or None)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "pytorch_lora_weights.safetensors").is_file() and (path / PEFT_WEIGHTS).is_file():
            return path / PEFT_WEIGHTS, path / PEFT_CONFIG
        return path / "pytorch_lora_weights.safetensors", None
    return path, None


def peft_to_diffusers(state_dict: dict[str, torch.Tensor], config_path: Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter of the transformer (`base_model.model.<module>.lora_A.weight`, scaled by the
    config's lora_alpha / r at run time) -> diffusers' layout (`transformer.<module>.lora_A.weight`)
    with lora_alpha / r folded into lora_B, as Spindle's own exports are (diffusers then reads the
    scale as 1). Variants that are not plain LoRA are refused, naming the config key."""
    import json

    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: a PEFT adapter folder needs its {PEFT_CONFIG}")
    config = json.loads(config_path.read_text())
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(
                f"{config_path}: {key} (per-module ranks or alphas) is not supported; give one r / lora_alpha"
            )
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise ValueError(f"{config_path}: {key} adapters are not supported; plain LoRA only")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(
            f"{config_path}: needs an integer r >= 1 and a number lora_alpha; got r={rank!r}, lora_alpha={alpha!r}"
        )
    out = {}
    for key, value in state_dict.items():
        name = "transformer." + key.removeprefix(PEFT_PREFIX)
        out[name] = value * (alpha / rank) if ".lora_B." in name else value
    return out


def lora_pipeline(family: Any, components: dict[str, Any]) -> Any:
    """The family's diffusers pipeline around the engine's loaded components (no copy of any weight):
    what diffusers' LoRA loading and adapter switching (`set_adapters`, `delete_adapters`) run on."""
    cls = family.lora_pipeline_class()
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
    into = {"load_into_transformer_2": True} if lora_component(path) == "transformer_2" else {}
    try:
        pipe.load_lora_weights(state_dict, adapter_name=adapter_name, **into)
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


# the denoisers a LoRA may adapt: diffusers' `load_lora_weights` loads into `transformer`, or into a
# two-expert pipeline's `transformer_2` with `load_into_transformer_2=True`
LORA_COMPONENTS = ("transformer", "transformer_2")


def lora_component(path: str | Path) -> str:
    """The transformer a Spindle-trained LoRA is for: a two-expert checkpoint's `transformer_2` when its
    spindle.json says so (stock `load_lora_weights(..., load_into_transformer_2=True)` puts it there)."""
    from spindle.export.record import read_export_record

    return str(read_export_record(path).get("component", "transformer"))


def lora_transformer(family: Any, components: dict[str, Any], path: str | Path) -> Any:
    """The component the LoRA at `path` adapts; a component the checkpoint lacks raises `ValueError`."""
    component = lora_component(path)
    if component not in LORA_COMPONENTS or components.get(component) is None:
        raise ValueError(
            f"LoRA {path} was trained for the checkpoint's {component!r}, which this {family.name} checkpoint lacks"
        )
    return components[component]


def apply_lora_file(family: Any, components: dict[str, Any], path: str | Path, scale: float = 1.0) -> None:
    """Load the LoRA at `path` into `components["transformer"]` (in place) with weight `scale`; a LoRA that
    Spindle trained for a two-expert checkpoint's `transformer_2` goes there (`lora_component`)."""
    transformer = lora_transformer(family, components, path)
    pipe = lora_pipeline(family, components)
    load_adapter(family, pipe, transformer, path, ADAPTER)
    if scale != 1.0:
        pipe.set_adapters([ADAPTER], adapter_weights=[float(scale)])
    transformer.requires_grad_(False)
