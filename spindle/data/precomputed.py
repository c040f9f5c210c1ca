"""A cache of a DiT dataset's conditions (latents, text embeddings): written by `spindle precompute`,
read by training with `data.precomputed: DIR` so the text encoders and the VAE never load.

Layout of DIR:
    manifest.json            {"format", "settings": {...}, "samples": [{"key", "file"}, ...]}
    samples/00000012.safetensors   one sample's conditions (no batch dim), as `encode` returned them

The condition model's `encode` is a pure function of a sample (VAE posterior mode, padded prompts),
so the cache holds exactly what training would compute. A cache is valid for a run only when every
setting that shapes the conditions matches (`cache_settings`: family, the frozen components'
identity, resolution, frames, max text length, dtype) and every sample is the one it was made from
(`sample_key`: file, size, modification time, caption); anything else is refused with what differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from spindle.data.datasets import Sample

FORMAT = 1
MANIFEST = "manifest.json"
_PROBE = 1 << 20  # bytes hashed at each end of a weight file


def _file_fingerprint(path: Path) -> str:
    """Size + hashes of the first and last MiB: tells checkpoints apart without reading 10 GB encoders."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(_PROBE))
        if size > 2 * _PROBE:
            f.seek(size - _PROBE)
            digest.update(f.read(_PROBE))
    return digest.hexdigest()[:16]


def checkpoint_identity(root: str | Path, skip: tuple[str, ...] = ("transformer",)) -> str:
    """An identity of a checkpoint's frozen components: every file outside `skip` (the trained part)."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root)
        if rel.parts[0] in skip or rel.parts[0].startswith("."):
            continue
        digest.update(f"{rel}:{_file_fingerprint(path)}\n".encode())
    return digest.hexdigest()[:16]


def cache_settings(cfg: Any, family: str, dtype: torch.dtype) -> dict[str, Any]:
    """Everything the cached conditions depend on besides the sample itself."""
    return {
        "family": family,
        "checkpoint": checkpoint_identity(cfg.model.path),
        "resolution": list(cfg.data.resolution),
        "num_frames": cfg.data.num_frames,
        "max_text_length": cfg.model.max_text_length,
        "dtype": str(dtype).removeprefix("torch."),
    }


def sample_key(sample: Sample) -> str:
    stat = sample.path.stat()
    caption = hashlib.sha256(sample.caption.encode()).hexdigest()[:16]
    key = f"{sample.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{caption}"
    for tag, path in (("", sample.image), ("last=", sample.last_image)):  # conditioning images are conditions
        if path is not None:
            stat = path.stat()
            key += f"|{tag}{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return key


def sample_file(index: int) -> str:
    return f"samples/{index:08d}.safetensors"


def write_sample(out: Path, index: int, conditions: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    path = out / sample_file(index)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in conditions.items()}, str(path))


def write_manifest(out: Path, settings: dict[str, Any], samples: list[Sample]) -> Path:
    entries = [{"key": sample_key(s), "file": sample_file(i)} for i, s in enumerate(samples)]
    missing = [e["file"] for e in entries if not (out / e["file"]).is_file()]
    if missing:
        raise RuntimeError(f"precompute left {len(missing)} samples unwritten (first: {missing[0]})")
    path = out / MANIFEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "settings": settings, "samples": entries}, indent=1))
    tmp.rename(path)  # the manifest appears last: a cache without one is incomplete
    return path


class StaleCacheError(ValueError):
    """The cache was made for other settings, another checkpoint or other data."""


def check_cache(root: Path, settings: dict[str, Any], samples: list[Sample]) -> list[dict[str, str]]:
    """The manifest's sample entries, after checking the cache matches this run; else a clear error."""
    path = root / MANIFEST
    fix = "rerun `spindle precompute CONFIG --out DIR` with this run's config"
    if not path.is_file():
        raise FileNotFoundError(f"data.precomputed: {path} not found (an unfinished or missing cache); {fix}")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as e:
        raise StaleCacheError(f"data.precomputed: {path} is not valid JSON ({e}); {fix}") from None
    if manifest.get("format") != FORMAT:
        raise StaleCacheError(
            f"data.precomputed: {root} has cache format {manifest.get('format')}, not {FORMAT}; {fix}"
        )
    made = manifest["settings"]
    differs = [f"{k}: cache {made.get(k)!r}, this run {v!r}" for k, v in settings.items() if made.get(k) != v]
    if differs:
        what = "; ".join(differs)
        hint = " (the cache comes from another checkpoint)" if made.get("checkpoint") != settings["checkpoint"] else ""
        raise StaleCacheError(f"data.precomputed: {root} does not match this run{hint}: {what}; {fix}")
    entries = manifest["samples"]
    if len(entries) != len(samples):
        raise StaleCacheError(
            f"data.precomputed: {root} holds {len(entries)} samples, data.path lists {len(samples)}; {fix}"
        )
    changed = [s.path for s, e in zip(samples, entries, strict=True) if sample_key(s) != e["key"]]
    if changed:
        raise StaleCacheError(
            f"data.precomputed: {len(changed)} samples changed since the cache was made (file or caption; "
            f"first: {changed[0]}); {fix}"
        )
    return entries


class CachedConditions(Dataset):
    """{"conditions": {name: tensor}, "index": int} per sample, read from a checked cache."""

    def __init__(self, root: str | Path, settings: dict[str, Any], samples: list[Sample]):
        self.root = Path(root)
        self.entries = check_cache(self.root, settings, samples)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = self.root / self.entries[index]["file"]
        try:
            conditions = load_file(str(path))
        except (SafetensorError, OSError) as e:  # the bare error names no file
            raise StaleCacheError(
                f"data.precomputed: {path} is damaged or missing ({e}); rerun `spindle precompute CONFIG --out DIR`"
            ) from None
        return {"conditions": conditions, "index": index}


def collate_conditions(items: list[dict[str, Any]]) -> dict[str, Any]:
    names = items[0]["conditions"].keys()
    return {
        "conditions": {n: torch.stack([it["conditions"][n] for it in items]) for n in names},
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
