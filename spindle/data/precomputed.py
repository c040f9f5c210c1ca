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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import Sample

FORMAT = 1
MANIFEST = "manifest.json"
EMPTY = "empty.safetensors"  # the empty caption's text conditions (data.caption_dropout)
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


def cache_settings(cfg: Any, family: str, dtype: torch.dtype, encoding: int = 1) -> dict[str, Any]:
    """Everything the cached conditions depend on besides the sample itself. `encoding`: the family condition
    model's `encoding_version` (bumped when its `encode` changes, so older caches are refused, not misread)."""
    return {
        "family": family,
        "encoding": encoding,
        "checkpoint": checkpoint_identity(cfg.model.path),
        "resolution": list(cfg.data.resolution),
        "num_frames": cfg.data.num_frames,
        # each sample's shape (its bucket) and caption text depend on these too
        "buckets": cfg.data.buckets if isinstance(cfg.data.buckets, bool) else cfg.data.buckets.model_dump(),
        "caption_prefix": cfg.data.caption_prefix,
        "max_text_length": cfg.model.max_text_length,
        "dtype": str(dtype).removeprefix("torch."),
    }


def sample_key(sample: Sample) -> str:
    stat = sample.path.stat()
    caption = hashlib.sha256("\n".join(sample.captions or (sample.caption,)).encode()).hexdigest()[:16]
    key = f"{sample.path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{caption}"
    for tag, path in (("", sample.image), ("last=", sample.last_image), *(("source=", p) for p in sample.sources)):
        if path is not None:  # conditioning / source images are part of the cached conditions
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


def variant_key(key: str, caption: int) -> str:
    """The name of condition `key` for a sample's `caption`-th caption (beyond the first) in its file."""
    return f"{key}@caption{caption}"


def write_empty(out: Path, conditions: dict[str, torch.Tensor]) -> None:
    """The empty caption's text conditions (no batch dim): what data.caption_dropout swaps in."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in conditions.items()}, str(out / EMPTY))


def write_manifest(out: Path, settings: dict[str, Any], samples: Sequence[Sample], text_keys: list[str]) -> Path:
    """`text_keys`: the conditions a caption changes (swapped for another caption or the empty one)."""
    entries = [{"key": sample_key(s), "file": sample_file(i)} for i, s in enumerate(samples)]
    missing = [e["file"] for e in entries if not (out / e["file"]).is_file()]
    if missing:
        raise RuntimeError(f"precompute left {len(missing)} samples unwritten (first: {missing[0]})")
    path = out / MANIFEST
    tmp = path.with_suffix(".tmp")
    manifest = {"format": FORMAT, "settings": settings, "text_keys": text_keys, "samples": entries}
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(path)  # the manifest appears last: a cache without one is incomplete
    return path


class StaleCacheError(ValueError):
    """The cache was made for other settings, another checkpoint or other data."""


def check_cache(root: Path, settings: dict[str, Any], samples: Sequence[Sample]) -> dict[str, Any]:
    """The manifest, after checking the cache matches this run; else a clear error."""
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
    return dict(manifest)


class CachedConditions(Dataset):
    """{"conditions": {name: tensor}, "index": int} per sample, read from a checked cache.

    With `captions` (the run's `CaptionPolicy`), each epoch's caption draw is applied as the media path
    applies it: a sample's other captions were cached as `variant_key` entries, the empty caption once
    (`EMPTY`); the draw swaps the manifest's `text_keys` for them."""

    def __init__(
        self,
        root: str | Path,
        settings: dict[str, Any],
        samples: Sequence[Sample],
        captions: CaptionPolicy | None = None,
    ):
        self.root = Path(root)
        manifest = check_cache(self.root, settings, samples)
        self.entries = manifest["samples"]
        self.text_keys: list[str] = manifest.get("text_keys", [])
        self.captions = captions or CaptionPolicy()
        self.epoch = 0
        self._empty: dict[str, torch.Tensor] | None = None
        if self.captions.dropout and not (self.root / EMPTY).is_file():
            raise StaleCacheError(
                f"data.precomputed: {self.root} holds no empty-caption conditions (made before data.caption_dropout "
                "was cached); rerun `spindle precompute CONFIG --out DIR`"
            )

    def __len__(self) -> int:
        return len(self.entries)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def empty(self) -> dict[str, torch.Tensor]:
        if self._empty is None:
            from safetensors.torch import load_file

            self._empty = load_file(str(self.root / EMPTY))
        return self._empty

    def draw_caption(self, conditions: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
        """`conditions` with the text of the caption drawn for (epoch, index); the variants dropped."""
        variants = {k for k in conditions if "@caption" in k}
        count = 1 + len({k.rpartition("@caption")[2] for k in variants})
        j = self.captions.pick(count, self.epoch, index)
        if j is None:
            conditions.update(self.empty())
        elif j:
            conditions.update({k: conditions[variant_key(k, j)] for k in self.text_keys})
        return {k: v for k, v in conditions.items() if k not in variants}

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
        return {"conditions": self.draw_caption(conditions, index), "index": index}


def collate_conditions(items: list[dict[str, Any]]) -> dict[str, Any]:
    names = items[0]["conditions"].keys()
    return {
        "conditions": {n: torch.stack([it["conditions"][n] for it in items]) for n in names},
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
