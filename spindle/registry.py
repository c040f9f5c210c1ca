"""Family registry: family name / diffusers `_class_name` / transformers `model_type` -> family spec, lazily.

A family package (`spindle/models/<family>/__init__.py`) defines `FAMILY` (a `DiTFamily`, or an
LLM family spec with `model_types`); every family names its training task (`family.task`, see
`spindle.train.tasks`). The registry knows only the module paths, so importing Spindle imports no
model code.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:  # the registry itself imports no model code
    from spindle.models.base import CausalLMFamily, DiTFamily

Family: TypeAlias = "DiTFamily | CausalLMFamily"

# name -> module defining FAMILY. Adding a family: one line here, one folder under models/.
BUILTIN_FAMILIES: dict[str, str] = {
    "flux": "spindle.models.flux",
    "llama": "spindle.models.llama",
    "qwen3": "spindle.models.qwen3",
    "wan": "spindle.models.wan",
}


class UnknownModelError(ValueError):
    """The checkpoint (or family name) is not served by any registered family."""


def family_names() -> list[str]:
    return sorted(BUILTIN_FAMILIES)


def get_family(name: str) -> Family:
    if name not in BUILTIN_FAMILIES:
        raise UnknownModelError(f"unknown model family {name!r}; known families: {', '.join(family_names())}")
    family: Family = importlib.import_module(BUILTIN_FAMILIES[name]).FAMILY
    return family


def all_families() -> list[Family]:
    return [get_family(n) for n in family_names()]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except json.JSONDecodeError as e:
        raise UnknownModelError(f"{path} is not valid JSON: {e}") from e


def dit_family_of(path: str | Path, name: str | None = None) -> DiTFamily:
    """`family_of` for code that needs a diffusion family (flow-matching training, the DiT engine)."""
    from spindle.models.base import DiTFamily

    family = family_of(path, name)
    if not isinstance(family, DiTFamily):
        raise UnknownModelError(f"{path}: family {family.name!r} is a language model, not a diffusion family")
    return family


def causal_lm_family_of(path: str | Path, name: str | None = None) -> CausalLMFamily:
    """`family_of` for code that needs a language-model family (causal-LM training and export)."""
    from spindle.models.base import CausalLMFamily

    family = family_of(path, name)
    if not isinstance(family, CausalLMFamily):
        raise UnknownModelError(f"{path}: family {family.name!r} is a diffusion family, not a language model")
    return family


def _diffusers_classes(family: Family) -> tuple[str, ...]:
    """The pipeline and transformer `_class_name`s a diffusion family serves (none for an LLM family)."""
    return (*getattr(family, "pipeline_classes", ()), *getattr(family, "transformer_classes", ()))


def family_of(path: str | Path, name: str | None = None) -> Family:
    """The family named `name`, else the one that serves the checkpoint at `path`."""
    return get_family(name) if name else resolve_family(path)


def _resolve_transformers_folder(root: Path) -> Family:
    """A transformers folder (config.json with model_type) -> the family declaring that model_type."""
    model_type = _read_json(root / "config.json").get("model_type")
    families = all_families()
    for fam in families:
        if model_type in getattr(fam, "model_types", ()):
            return fam
    known = sorted(t for f in families for t in getattr(f, "model_types", ()))
    raise UnknownModelError(
        f"no Spindle family serves {root} (transformers model_type {model_type!r}); "
        f"known model types: {', '.join(known) or 'none'}"
    )


def resolve_family(root: str | Path) -> Family:
    """Find the family serving a checkpoint folder.

    A diffusers pipeline folder (model_index.json): pipeline `_class_name`, then the transformer's
    `_class_name`, then each family's detector (for renamed or hand-assembled local folders).
    A transformers folder (config.json with `model_type`): the family declaring that model type.
    """
    root = Path(root)
    index_path = root / "model_index.json"
    if not root.is_dir():
        raise FileNotFoundError(
            f"model path {root} does not exist (expected a diffusers pipeline folder or a transformers model folder)"
        )
    if not index_path.is_file():
        if (root / "config.json").is_file():
            return _resolve_transformers_folder(root)
        raise FileNotFoundError(
            f"{index_path} not found: model.path must be a diffusers pipeline folder (model_index.json) or a "
            "transformers model folder (config.json with model_type)"
        )
    pipeline_cls = _read_json(index_path).get("_class_name")
    tcfg_path = root / "transformer" / "config.json"
    transformer_cls = _read_json(tcfg_path).get("_class_name") if tcfg_path.is_file() else None
    families = all_families()
    for fam in families:
        if pipeline_cls in getattr(fam, "pipeline_classes", ()):
            return fam
    for fam in families:
        if transformer_cls in getattr(fam, "transformer_classes", ()):
            return fam
    for fam in families:
        detect = getattr(fam, "detect", None)
        if detect is not None and detect(root):
            return fam
    known = ", ".join(f"{f.name} ({', '.join(_diffusers_classes(f))})" for f in families if _diffusers_classes(f))
    raise UnknownModelError(
        f"no Spindle family serves {root} (pipeline class {pipeline_cls!r}, transformer class "
        f"{transformer_cls!r}); known families: {known}"
    )
