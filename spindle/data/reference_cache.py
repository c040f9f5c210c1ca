"""A cache of DPO's reference log-probabilities (`dpo.precompute_reference`): each pair's summed log-probability of
its chosen and its rejected completion under the reference, computed once before training so that no reference
model is held (or run) while the policy trains.

The file is `<train.output_dir>/reference_logps.safetensors`: one float32 tensor `logps` [pairs, 2] (chosen,
rejected) in the order `spindle.data.preference.preference_pairs` reads the data, and in its metadata the
settings the values depend on (`reference_settings`). A resumed run reads it back instead of computing it again
(a full fine-tune's policy is no longer the starting weights by then); a cache made for other settings, data or
weights is refused naming what differs, never trained against. Written atomically by rank 0.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from spindle.data.precomputed import checkpoint_identity, write_atomically

FILE = "reference_logps.safetensors"
FORMAT = 1


def cache_path(cfg: Any) -> Path:
    return Path(cfg.train.output_dir) / FILE


def data_identity(path: str | Path) -> str:
    """The preference file(s)' content: each JSONL file's name and SHA-256 (a folder: its files in sorted order,
    as the reader takes them)."""
    root = Path(path)
    files = sorted(root.rglob("*.jsonl")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.relative_to(root) if root.is_dir() else file.name}:".encode())
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def reference_settings(cfg: Any) -> dict[str, Any]:
    """What the cached values depend on: the data, the tokenizer and starting weights (`model.path`), the
    reference (`dpo.reference_model`, or the starting weights), the truncation and the precision."""
    reference = cfg.dpo.reference_model
    return {
        "format": FORMAT,
        "data": data_identity(cfg.data.path),
        "model": checkpoint_identity(cfg.model.path, skip=()),
        "reference": "model.path" if reference is None else checkpoint_identity(reference, skip=()),
        "seq_len": cfg.data.seq_len,
        "max_prompt_length": cfg.dpo.max_prompt_length,
        "mixed_precision": str(cfg.train.mixed_precision),
    }


_WHAT = {
    "format": "Spindle's cache format",
    "data": "data.path (the preference pairs' content)",
    "model": "model.path (the starting weights or tokenizer)",
    "reference": "dpo.reference_model (or its weights)",
    "seq_len": "data.seq_len",
    "max_prompt_length": "dpo.max_prompt_length",
    "mixed_precision": "train.mixed_precision",
}


def stale_keys(path: Path, settings: dict[str, Any]) -> list[str] | None:
    """None when `path` holds no cache; else the settings it was made for that differ from `settings` ([] when it
    is current), each named as the user sets it."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            cached = json.loads((f.metadata() or {}).get("settings", "{}"))
    except (OSError, ValueError, SafetensorError):  # cut short or not safetensors: not a cache of this run
        return ["the file itself (unreadable)"]
    return [_WHAT.get(k, k) for k in settings if cached.get(k) != settings[k]]


def read_cache(path: Path, pairs: int) -> torch.Tensor:
    """The cached [pairs, 2] log-probabilities (checked current by `stale_keys` first)."""
    from safetensors.torch import load_file

    logps = load_file(str(path))["logps"]
    if logps.shape != (pairs, 2):
        raise ValueError(f"{path} holds reference log-probabilities of {logps.shape[0]} pairs; the data has {pairs}")
    return logps


def write_cache(path: Path, logps: torch.Tensor, settings: dict[str, Any]) -> None:
    from safetensors.torch import save

    data = save({"logps": logps.detach().cpu().float().contiguous()}, metadata={"settings": json.dumps(settings)})
    write_atomically(path, data)
