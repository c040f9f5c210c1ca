"""Reading a diffusers pipeline folder's `model_index.json`: the one place that parses it.

The registry (which family serves a folder), the inference engine (which components to load), the
training task (which component it trains) and the families' condition models (which encoders to skip)
all read the same file; each reads it here, so a missing or damaged file gets one message naming it.
Imports nothing of Spindle and nothing heavy: the registry reads it at `spindle --help` speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MODEL_INDEX = "model_index.json"


def model_index_path(root: str | Path) -> Path:
    return Path(root) / MODEL_INDEX


def has_model_index(root: str | Path) -> bool:
    """Whether `root` is a diffusers pipeline folder (has a model_index.json)."""
    return model_index_path(root).is_file()


def read_model_index(root: str | Path, *, missing_ok: bool = False) -> dict[str, Any]:
    """`root/model_index.json` as a dict: component name -> [library, class] (None entries for components
    the folder lacks) and the pipeline's config values (`_class_name`, `boundary_ratio`, ...).

    A folder without one is a FileNotFoundError naming the file (`missing_ok`: {} instead, where the
    loaders that run next name what is missing); a file that is not a JSON object is a ValueError naming it.
    """
    path = model_index_path(root)
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"{path} not found: the model must be a diffusers pipeline folder with {MODEL_INDEX}")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(index, dict):
        raise ValueError(f"{path} holds a JSON {type(index).__name__}, not the object a diffusers pipeline writes")
    return index


def component_class(index: dict[str, Any], name: str) -> str | None:
    """The class name model_index.json gives for component `name` (`["diffusers", "AutoencoderKLWan"]` ->
    "AutoencoderKLWan"), or None where the folder has none (absent, or `[null, null]`)."""
    entry = index.get(name)
    if isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None:
        return str(entry[1])
    return None
