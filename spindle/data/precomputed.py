"""A cache of a DiT dataset's conditions (latents, text embeddings): written by `spindle precompute`,
read by training with `data.precomputed: DIR` so the text encoders and the VAE never load.

Layout of DIR:
    manifest.json            {"format", "settings": {...}, "text_keys", "empty": {"size", "sha256"},
                              "samples": [{"key", "file", "size", "sha256"}, ...]}
    samples/00000012.safetensors   one sample's conditions (no batch dim), as `encode` returned them
    empty.safetensors        the empty caption's text conditions (data.caption_dropout)

Writing is atomic and checked: each file is written to a temporary beside it and renamed, its size and
SHA-256 recorded as it is written; `spindle precompute` holds `.precompute.lock` (a second one into the
same folder is refused), removes the old manifest before it writes anything and writes the new one last,
so an interrupted run leaves a cache that training refuses as incomplete. Training checks every file
against its manifest entry (`check_cache`: present, its size, and its hash when the cache is at most
`VERIFY_BYTES`; a bigger cache has each file's hash checked as it is read), so a swapped, duplicated or
overwritten file is named, never trained on as another sample's conditions.

The condition model's `encode` is a pure function of a sample (VAE posterior mode, padded prompts),
so the cache holds exactly what training would compute. A cache is valid for a run only when every
setting that shapes the conditions matches (`cache_settings`: family, the frozen components'
identity, resolution, frames, max text length, dtype) and every sample is the one it was made from
(`sample_key`: file, size, modification time, caption); anything else is refused with what differs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import Sample

FORMAT = 2  # 2: every file's size and SHA-256 in the manifest (format 1 caches are refused: rerun precompute)
MANIFEST = "manifest.json"
EMPTY = "empty.safetensors"  # the empty caption's text conditions (data.caption_dropout)
LOCK = ".precompute.lock"
RECORDS = ".records"  # each rank's {file: record} of what it wrote, merged into the manifest by rank 0
VERIFY_BYTES = 4 << 30  # caches up to this size are hashed in full before training (about a few seconds)
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
        # data.audio: the cache holds each clip's audio latents too (a cache without them is refused); the key
        # is absent without it, so caches written before it existed stay valid
        **({"audio": True} if getattr(cfg.data, "audio", False) else {}),
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


def write_atomically(path: Path, data: bytes) -> dict[str, Any]:
    """Write `data` to `path` through a temporary beside it and a rename (a reader never sees half a
    file); -> its manifest record {"size", "sha256"}. Not fsync'ed: a file a power loss leaves empty or
    short fails its recorded hash when training checks it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _tensor_bytes(conditions: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in conditions.items()})


def write_sample(out: Path, index: int, conditions: dict[str, torch.Tensor]) -> dict[str, Any]:
    """One sample's conditions -> `samples/<index>.safetensors`; -> its manifest record."""
    return write_atomically(out / sample_file(index), _tensor_bytes(conditions))


def variant_key(key: str, caption: int) -> str:
    """The name of condition `key` for a sample's `caption`-th caption (beyond the first) in its file."""
    return f"{key}@caption{caption}"


def write_empty(out: Path, conditions: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The empty caption's text conditions (no batch dim): what data.caption_dropout swaps in."""
    return write_atomically(out / EMPTY, _tensor_bytes(conditions))


class CacheLockedError(ValueError):
    """Another `spindle precompute` is writing the cache folder."""


@contextmanager
def cache_lock(out: Path) -> Iterator[None]:
    """Hold the cache folder for one `spindle precompute` (an flock on `out/.precompute.lock`, released by
    the system when the process ends, however it ends); a second one is refused, naming the holder."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK
    with path.open("a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise CacheLockedError(
                f"--out {out} is being written by another spindle precompute ({holder}); wait for it to finish "
                "or choose another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def begin_cache(out: Path) -> None:
    """Before any file is written (main process): the old manifest and rank records go, so a run that
    stops part way leaves a cache without a manifest, which training refuses as unfinished."""
    (out / MANIFEST).unlink(missing_ok=True)
    for old in [*(out / RECORDS).glob("*.json"), *out.glob(".*.tmp"), *(out / "samples").glob(".*.tmp")]:
        old.unlink()  # records of an earlier run, temporaries a killed one left


def write_records(out: Path, rank: int, records: dict[str, dict[str, Any]]) -> None:
    """This rank's {file: record} of what it wrote, for rank 0's manifest."""
    write_atomically(out / RECORDS / f"rank-{rank:05d}.json", json.dumps(records).encode())


def read_records(out: Path) -> dict[str, dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    for path in sorted((out / RECORDS).glob("*.json")):
        records.update(json.loads(path.read_bytes()))
    return records


def write_manifest(
    out: Path,
    settings: dict[str, Any],
    samples: Sequence[Sample],
    text_keys: list[str],
    records: dict[str, dict[str, Any]],
) -> Path:
    """`text_keys`: the conditions a caption changes (swapped for another caption or the empty one);
    `records`: {file: {"size", "sha256"}} of every file this precompute wrote (`read_records`)."""
    entries = [{"key": sample_key(s), "file": sample_file(i)} for i, s in enumerate(samples)]
    missing = [e["file"] for e in entries if e["file"] not in records or not (out / e["file"]).is_file()]
    if missing:
        raise RuntimeError(f"precompute left {len(missing)} samples unwritten (first: {missing[0]})")
    manifest: dict[str, Any] = {"format": FORMAT, "settings": settings, "text_keys": text_keys}
    if EMPTY in records:
        manifest["empty"] = records[EMPTY]
    manifest["samples"] = [{**e, **records[e["file"]]} for e in entries]
    write_atomically(out / MANIFEST, json.dumps(manifest, indent=1).encode())  # last: the cache is complete
    return out / MANIFEST


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
    listed = [(e["file"], e) for e in entries] + ([(EMPTY, manifest["empty"])] if "empty" in manifest else [])
    hashed = sum(int(e["size"]) for _, e in listed) <= VERIFY_BYTES
    if problems := [p for name, e in listed if (p := file_problem(root / name, e, hashed)) is not None]:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise StaleCacheError(
            f"data.precomputed: {len(problems)} file(s) of {root} do not match the manifest: {shown}; {fix}"
        )
    return {**manifest, "verified": hashed}


def file_problem(path: Path, record: dict[str, Any], hashed: bool = True) -> str | None:
    """What is wrong with one cache file against its manifest record (naming it), or None; `hashed`: its
    content too, not only its size."""
    if not path.is_file():
        return f"{path} is missing"
    if (size := path.stat().st_size) != record["size"]:
        return f"{path} has {size} bytes, its manifest entry {record['size']} (overwritten or truncated)"
    if hashed:
        return content_problem(path, path.read_bytes(), record)
    return None


def content_problem(path: Path, data: bytes, record: dict[str, Any]) -> str | None:
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return f"{path} is not the file its manifest entry records (another sample's, swapped or copied, or damaged)"
    return None


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
        self.verified = bool(manifest["verified"])  # every file hashed already; else each as it is read
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
        return self.load(index)

    def load(self, index: int, key: int | None = None) -> dict[str, Any]:
        """Entry `index`'s conditions, its caption drawn (and its "index" reported) as sample `key`'s (default:
        `index`; a preference pair's members share their pair's)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        key = index if key is None else key
        entry = self.entries[index]
        path = self.root / entry["file"]
        fix = "rerun `spindle precompute CONFIG --out DIR`"
        try:
            data = path.read_bytes()
            if not self.verified and (problem := content_problem(path, data, entry)) is not None:
                raise StaleCacheError(f"data.precomputed: {problem}; {fix}")
            conditions = load(data)
        except (SafetensorError, OSError) as e:  # the bare error names no file
            raise StaleCacheError(f"data.precomputed: {path} is damaged or missing ({e}); {fix}") from None
        return {"conditions": self.draw_caption(conditions, key), "index": key}


def collate_conditions(items: list[dict[str, Any]]) -> dict[str, Any]:
    names = items[0]["conditions"].keys()
    return {
        "conditions": {n: torch.stack([it["conditions"][n] for it in items]) for n in names},
        "index": torch.tensor([it["index"] for it in items], dtype=torch.long),
    }
