"""A lazy index over JSONL manifests: one .jsonl file, or a folder (tree) of .jsonl shards.

A dataset of millions of lines is never held as Python objects: the index is a few numpy arrays (each
usable line's byte offset and line number, the shard boundaries, and the declared media sizes when
every line gives them: about 20 bytes a sample), and a sample is parsed from its line when it is read,
so each rank reads only the lines of its own batches.

Building the index reads every shard once (every line is checked then, so a bad line is reported at
start-up, naming its file and line); the index is cached under the Spindle cache folder
(`SPINDLE_CACHE_DIR`), keyed on every shard's path, size and modification time, so a resumed or
repeated run loads it in milliseconds and a changed shard is re-indexed.

A line may declare its media's size, `"width"`, `"height"` (and `"frames"` for a video): buckets then
need no file probe (`spindle.data.buckets.source_sizes`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from spindle.data.media_check import Problem

INDEX_VERSION = 1


def is_shard_folder(path: Path) -> bool:
    """A folder holding .jsonl shards (and no media files): a sharded manifest."""
    from spindle.data.media import is_media_path

    if not path.is_dir():
        return False
    has_shards = False
    for p in path.rglob("*"):
        if p.is_file() and is_media_path(p):
            return False
        has_shards = has_shards or p.suffix.lower() == ".jsonl"
    return has_shards


def list_shards(path: Path) -> list[Path]:
    """The .jsonl shards of `path` (itself, or every one below it, sorted, hidden entries ignored)."""
    if path.is_file():
        return [path]
    shards = (p for p in path.rglob("*.jsonl") if p.is_file())
    return sorted(
        (p for p in shards if not any(part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).as_posix(),
    )


def _cache_path(shards: Sequence[Path]) -> Path:
    from spindle.data.media_check import cache_dir

    digest = hashlib.sha256(f"index:{INDEX_VERSION}".encode())
    for shard in shards:
        st = shard.stat()
        digest.update(f"{shard.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return cache_dir() / f"index-{digest.hexdigest()[:32]}.npz"


def _line_starts(data: bytes) -> np.ndarray:
    """Byte offsets of every line of `data` (the last line may lack its newline)."""
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0x0A)
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    return starts[starts < len(data)]


class ShardedManifest(Sequence[Any]):
    """The usable samples of JSONL shards as a lazy sequence of `Sample`s (see the module docstring).

    `problems`: the lines listed but not usable (an empty caption), as the in-memory reading reports them.
    """

    def __init__(
        self,
        shards: list[Path],
        shard_of: np.ndarray,
        offsets: np.ndarray,
        lines: np.ndarray,
        sizes: np.ndarray | None,
        problems: list[Problem],
        videos: np.ndarray,
        parse: Callable[[Path, int, str], Any],
    ):
        self.shards = shards
        self.shard_of = shard_of  # int32 per sample
        self.offsets = offsets  # int64 byte offset per sample
        self.lines = lines  # int32 1-based line number per sample (for messages)
        self.sizes = sizes  # int32 [n, 3] (frames, height, width), or None when some line gives none
        self.problems = problems
        self.videos = videos  # bool per sample: its media is a video (data.sources kinds)
        self.parse = parse  # (shard, line number, line) -> Sample, raising on a bad line
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()

    # ------------------------------------------------------------------ building

    @classmethod
    def open(cls, path: str | os.PathLike[str], parse: Callable[[Path, int, str], Any]) -> ShardedManifest:
        """The index of `path` (a .jsonl file or a folder of shards), from the cache when nothing changed;
        `parse(shard, line number, line)` -> the line's Sample (`spindle.data.datasets`)."""
        shards = list_shards(Path(path))
        if not shards:
            raise ValueError(f"dataset {path} holds no .jsonl shard")
        cache = _cache_path(shards)
        try:
            with np.load(cache) as z:
                sizes = z["sizes"] if z["sizes"].size else None
                problems = [Problem(Path(p), r) for p, r in json.loads(bytes(z["problems"]).decode())]
                return cls(shards, z["shard_of"], z["offsets"], z["lines"], sizes, problems, z["videos"], parse)
        except (OSError, ValueError, KeyError):
            pass  # absent, unreadable or from another version: index again
        index = cls.build(shards, parse)
        index.save(cache)
        return index

    @classmethod
    def build(cls, shards: list[Path], parse: Callable[[Path, int, str], Any]) -> ShardedManifest:
        """Read and check every line of every shard (a bad line raises, naming its file and line)."""
        from spindle.data.media import is_video_path

        shard_of, offsets, lines, sizes, videos = [], [], [], [], []
        problems: list[Problem] = []
        all_sized = True
        for k, shard in enumerate(shards):
            data = shard.read_bytes()
            starts = _line_starts(data)
            keep = np.zeros(len(starts), dtype=bool)
            ends = np.append(starts[1:], len(data))
            for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                line = data[start:end].decode("utf-8")
                if not line.strip():
                    continue
                sample = parse(shard, i + 1, line)
                if not sample.caption:
                    problems.append(Problem(sample.path, f"empty caption in {shard.name}"))
                    continue
                keep[i] = True
                videos.append(is_video_path(sample.path))
                all_sized = all_sized and sample.size is not None
                if all_sized:
                    sizes.append(sample.size)
            shard_of.append(np.full(int(keep.sum()), k, dtype=np.int32))
            offsets.append(starts[keep])
            lines.append((np.flatnonzero(keep) + 1).astype(np.int32))
        return cls(
            shards,
            np.concatenate(shard_of),
            np.concatenate(offsets),
            np.concatenate(lines),
            np.asarray(sizes, dtype=np.int32).reshape(-1, 3) if all_sized else None,
            problems,
            np.asarray(videos, dtype=bool),
            parse,
        )

    def save(self, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
            problems = json.dumps([[str(p.path), p.reason] for p in self.problems]).encode()
            sizes = self.sizes if self.sizes is not None else np.zeros(0, dtype=np.int32)
            np.savez(
                tmp,
                shard_of=self.shard_of,
                offsets=self.offsets,
                lines=self.lines,
                sizes=sizes,
                videos=self.videos,
                problems=np.frombuffer(problems, dtype=np.uint8),
            )
            tmp.replace(path)
        except OSError:
            pass  # a read-only cache only costs the next run a re-index

    def subset(self, keep: np.ndarray) -> ShardedManifest:
        """The samples where `keep` (a bool mask) is true."""
        sizes = self.sizes[keep] if self.sizes is not None else None
        return ShardedManifest(
            self.shards,
            self.shard_of[keep],
            self.offsets[keep],
            self.lines[keep],
            sizes,
            self.problems,
            self.videos[keep],
            self.parse,
        )

    # ------------------------------------------------------------------ reading

    def __len__(self) -> int:
        return len(self.offsets)

    def _file(self, k: int) -> Any:
        if self._pid != os.getpid():  # a forked loader worker: its own file handles
            self._files, self._pid = {}, os.getpid()
        if k not in self._files:
            self._files[k] = self.shards[k].open("rb")
        return self._files[k]

    def read(self, index: int) -> Any:
        k = int(self.shard_of[index])
        f = self._file(k)
        f.seek(int(self.offsets[index]))
        return self.parse(self.shards[k], int(self.lines[index]), f.readline().decode("utf-8"))

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...
    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self.read(i) for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for a manifest of {n}")
        return self.read(index % n)

    def __iter__(self) -> Iterator[Any]:
        return (self.read(i) for i in range(len(self)))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": {}}  # open files do not pickle (loader workers reopen them)
