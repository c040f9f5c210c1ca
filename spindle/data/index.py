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

from spindle.data.media import MEDIA_EXTENSIONS, VIDEO_EXTENSIONS
from spindle.data.media_check import Problem
from spindle.data.text import decode_line

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


def _shards_key(shards: Sequence[Path]) -> str:
    parts = []
    for shard in shards:
        st = shard.stat()
        parts.append(f"{shard.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return "\n".join(parts)


def _cache_path(shards: Sequence[Path]) -> Path:
    from spindle.data.media_check import cache_dir

    digest = hashlib.sha256(f"index:{INDEX_VERSION}\n{_shards_key(shards)}".encode())
    return cache_dir() / f"index-{digest.hexdigest()[:32]}.npz"


def _line_starts(data: bytes) -> np.ndarray:
    """Byte offsets of every line of `data` (the last line may lack its newline)."""
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 0x0A)
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    return starts[starts < len(data)]


def _simple_entry(entry: Any) -> tuple[str, str, tuple[int, int, int] | None] | None:
    """(path, caption, declared size) of the common parsed line, {"path": str, "caption": str (+ "width",
    "height", "frames" ints)} with a media extension, checked in a microsecond; None for anything else
    (a caption list, a conditioning image, a bad value), which the full parse then reads or refuses."""
    if not isinstance(entry, dict) or not entry.keys() <= _SIMPLE_KEYS:
        return None
    path, caption = entry.get("path"), entry.get("caption")
    if not isinstance(path, str) or not isinstance(caption, str):
        return None
    if os.path.splitext(path)[1].lower() not in MEDIA_EXTENSIONS:
        return None
    if "width" not in entry and "height" not in entry and "frames" not in entry:
        return path, caption.strip(), None
    frames, height, width = entry.get("frames", 1), entry.get("height"), entry.get("width")
    if not (isinstance(frames, int) and isinstance(height, int) and isinstance(width, int)):
        return None
    if (
        isinstance(frames, bool)
        or isinstance(height, bool)
        or isinstance(width, bool)
        or min(frames, height, width) < 1
    ):
        return None  # the full parse names the bad value
    return path, caption.strip(), (frames, height, width)


_SIMPLE_KEYS = {"path", "caption", "width", "height", "frames"}


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
        # what the samples are: the shards (path, size, mtime) and which of their lines are used
        digest = hashlib.sha256(_shards_key(shards).encode())
        digest.update(np.ascontiguousarray(shard_of).tobytes())
        digest.update(np.ascontiguousarray(lines).tobytes())
        self.identity = digest.hexdigest()

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

        shard_of: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        lines: list[np.ndarray] = []
        sizes: list[np.ndarray] = []
        videos: list[np.ndarray] = []
        problems: list[Problem] = []
        all_sized = True
        for k, shard in enumerate(shards):
            data = shard.read_bytes()
            starts = _line_starts(data)
            raw = data.split(b"\n")[: len(starts)]  # line i starts at starts[i]
            keep = np.zeros(len(starts), dtype=bool)
            shard_sizes: list[tuple[int, int, int] | None] = []
            shard_videos: list[bool] = []
            filled = [i for i, line in enumerate(raw) if line.strip()]
            try:  # the whole shard in one C call; a bad line makes it fail, and the per-line path names it
                entries = json.loads(b"[" + b",".join(raw[i] for i in filled) + b"]")
            except ValueError:
                entries = [None] * len(filled)
            for i, entry in zip(filled, entries, strict=True):
                simple = _simple_entry(entry)
                if simple is None:  # anything unusual: the full parse (its checks, its messages)
                    try:
                        text = decode_line(raw[i])
                    except ValueError as e:  # a bad sample like an empty caption: named, skippable
                        problems.append(Problem(shard, f"line {i + 1}: {e}"))
                        continue
                    sample = parse(shard, i + 1, text)
                    path, caption, size = str(sample.path), sample.caption, sample.size
                else:
                    path, caption, size = simple
                if not caption:  # named as the full parse resolves its path
                    line = raw[i].decode("utf-8")
                    problems.append(Problem(parse(shard, i + 1, line).path, f"empty caption in {shard.name}"))
                    continue
                keep[i] = True
                shard_videos.append(os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS)
                all_sized = all_sized and size is not None
                if all_sized:
                    shard_sizes.append(size)
            # kept as arrays shard by shard: the memory of the Python objects is one shard's at most
            videos.append(np.asarray(shard_videos, dtype=bool))
            if all_sized:
                sizes.append(np.asarray(shard_sizes, dtype=np.int32).reshape(-1, 3))
            shard_of.append(np.full(int(keep.sum()), k, dtype=np.int32))
            offsets.append(starts[keep])
            lines.append((np.flatnonzero(keep) + 1).astype(np.int32))
        return cls(
            shards,
            np.concatenate(shard_of),
            np.concatenate(offsets),
            np.concatenate(lines),
            np.concatenate(sizes) if all_sized else None,
            problems,
            np.concatenate(videos),
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
