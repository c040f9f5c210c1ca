"""Checkpoint integrity: sizes and CRC-32s recorded while writing, a manifest written last, fsync
before the rename, verification on resume, and disk-full errors that say so.

Every file of a checkpoint passes through a `HashingStream` as it is written (DCP's shards and
`.metadata` through `ManifestFileSystemWriter`, Spindle's own files through `write_durably`), so the
checksum costs a CRC-32 over bytes already in memory (about 2 GB/s of one core), never a re-read.
`manifest.json` lists {file: {"size", "crc32"}} and is the last file written into `step-N.tmp`;
every file and the folder are fsync'ed before `step-N.tmp` becomes `step-N`, so a power loss cannot
leave a complete-looking checkpoint of empty files.

`verify_checkpoint` reads each listed file once and compares size and CRC-32: flipped bytes, a
truncated or missing shard, a truncated `.metadata` or `trainer_state.json` are each named.
"""

from __future__ import annotations

import errno
import io
import json
import os
import zlib
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

MANIFEST = "manifest.json"
_CHUNK = 8 << 20
# ENOSPC: the disk is full; EDQUOT: the user's quota is (reported the same way, the fix is the same).
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the checkpoint and the file."""


class DiskFullError(OSError):
    """A write that ran out of space; the message says "No space left on device", the path and what to do."""

    def __init__(self, message: str, path: str | Path):
        super().__init__(errno.ENOSPC, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message


def is_disk_full(exc: BaseException) -> bool:
    """True when `exc` (or an exception it was raised from, or a rank's failure that DCP's
    CheckpointException wraps) is ENOSPC/EDQUOT. torch's C++ writers turn a failed write into a
    RuntimeError ("unexpected pos ..."), so the message is checked too."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        for failure in getattr(seen, "failures", {}).values():  # {rank: (exception, traceback)}
            wrapped = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(wrapped, BaseException) and is_disk_full(wrapped):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


class HashingStream(io.RawIOBase):
    """A write-only file wrapper that counts and CRC-32s every byte written through it."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw = raw
        self.size = 0
        self.crc = 0
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        try:
            written = self.raw.write(view)
        except OSError as e:
            self.error = e  # kept: torch's zip writer may re-raise it as a RuntimeError without the errno
            raise
        n = len(view) if written is None else written
        self.crc = zlib.crc32(view[:n], self.crc)
        self.size += n
        return n

    def tell(self) -> int:
        return self.size  # DCP records item offsets with tell(); the file is written front to back

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    def record(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording {file name: size and CRC-32} of every file it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, dict[str, Any]] = {}
        self.write_error: OSError | None = None

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            try:
                yield stream
            finally:
                self.write_error = self.write_error or stream.error
            self.records[Path(path).name] = stream.record()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # `.metadata.tmp` -> `.metadata`: the record follows the file
        if (record := self.records.pop(Path(path).name, None)) is not None:
            self.records[Path(new_path).name] = record


class ManifestFileSystemWriter(FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank, each fsync'ed) that also records what it wrote."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path, sync_files=True)
        self.fs: _HashingFileSystem = _HashingFileSystem()

    @property
    def records(self) -> dict[str, dict[str, Any]]:
        return self.fs.records

    @property
    def write_error(self) -> OSError | None:
        return self.fs.write_error


def write_durably(path: Path, data: bytes) -> dict[str, Any]:
    """Write `data` to `path` and fsync it; -> its manifest record."""
    with path.open("wb") as raw:
        stream = HashingStream(raw)
        stream.write(data)
        raw.flush()
        os.fsync(raw.fileno())
        return stream.record()


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (new files, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, step: int, records: dict[str, dict[str, Any]]) -> None:
    body = {"format": 1, "step": step, "files": dict(sorted(records.items()))}
    write_durably(folder / MANIFEST, (json.dumps(body, indent=1) + "\n").encode())


def read_manifest(folder: Path) -> dict[str, dict[str, Any]] | None:
    """{file: record} of a checkpoint; None when it has no manifest (written by an older Spindle)."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_bytes())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e}); the checkpoint is damaged") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: unreadable manifest (no 'files' table); the checkpoint is damaged")
    return files


def file_crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def check_file(folder: Path, name: str, record: dict[str, Any]) -> str | None:
    """What is wrong with one listed file (naming it), or None."""
    path = folder / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != record["size"]:
        return f"{path} has {size} bytes, the manifest records {record['size']} (truncated or overwritten)"
    crc = f"{file_crc32(path):08x}"
    if crc != record["crc32"]:
        return f"{path}: CRC-32 {crc} differs from the recorded {record['crc32']} (the bytes are damaged)"
    return None


def verify_files(folder: Path, names: Iterable[str], manifest: dict[str, dict[str, Any]]) -> list[str]:
    """Problems with the given files of a checkpoint (each message names its file)."""
    return [p for name in names if (p := check_file(folder, name, manifest[name])) is not None]
