"""Completing an omni model's export: the trained thinker's folder gets the input's untrained sub-models
(talker, speech decoder) byte for byte and the input's whole config, so the full model class loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from spindle.config import ConfigError

if TYPE_CHECKING:
    from spindle.contracts.family import OmniFamily
    from spindle.export.dtypes import ExportDtypes


# the file of an export that holds the untrained sub-models' tensors
UNTRAINED_FILE = "model-untrained.safetensors"


INDEX = "model.safetensors.index.json"


def copy_untrained(source: Path, folder: Path, family: OmniFamily) -> None:
    """The input checkpoint's untrained tensors -> `folder`/UNTRAINED_FILE, unchanged (safetensors reads a
    tensor's stored bytes and dtype and writes them back as they are), listed in the folder's index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from spindle.distributed.sharded_load import SafetensorsCheckpoint

    by_file: dict[str, list[str]] = {}
    for key, name in SafetensorsCheckpoint(source).files.items():
        if family.is_untrained(key):
            by_file.setdefault(name, []).append(key)
    untrained = {}
    for name, keys in sorted(by_file.items()):
        with safe_open(str(source / name), "pt") as f:
            untrained.update({k: f.get_tensor(k) for k in keys})
    if not untrained:
        raise ConfigError(
            f"{source} has no tensors under {list(family.untrained)}: not a whole {family.name} checkpoint "
            "(the export would not load in its full model class)"
        )
    save_file(untrained, str(folder / UNTRAINED_FILE), metadata={"format": "pt"})
    index_path = folder / INDEX
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: UNTRAINED_FILE for k in untrained})
    index.setdefault("metadata", {})["total_size"] = index.get("metadata", {}).get("total_size", 0) + sum(
        t.numel() * t.element_size() for t in untrained.values()
    )
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True))


def write_full_config(source: Path, folder: Path, dtypes: ExportDtypes) -> None:
    """The input's whole config.json (thinker, talker, token2wav), its thinker's dtype the export's."""
    config = json.loads((source / "config.json").read_text())
    config["thinker_config"]["dtype"] = str(dtypes.default).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
