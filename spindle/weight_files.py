"""Check a model folder's safetensors headers before loading it, so a damaged file is named.

A corrupt or truncated `.safetensors` file otherwise surfaces deep inside diffusers or transformers
as a bare `SafetensorError` ("Error while deserializing header: ...") that names no file. Reading
the headers costs a few kilobytes per file: the 8-byte header length, the JSON header, and the file
size against the largest tensor offset (which catches a truncated download).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

# safetensors caps the header at 100 MB; anything larger is a damaged length field.
_MAX_HEADER = 100_000_000


class WeightFileError(ValueError):
    """A weight file that cannot be read; the message names it and the fix."""


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with one safetensors file's header or size, or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is {size} bytes, too short for a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > min(_MAX_HEADER, size - 8):
            return f"declares a {length}-byte header in a {size}-byte file"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError) as e:
            return f"has an unreadable header ({e})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if any(not isinstance(e, int) for e in ends):
        return "has a header without integer data_offsets"
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"is truncated: {size} bytes, its header needs {needed}"
    return None


def check_weight_files(folder: str | Path) -> None:
    """Raise WeightFileError naming the first `*.safetensors` under `folder` whose header is damaged."""
    root = Path(folder)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else [root] if root.suffix == ".safetensors" else []
    for path in files:
        if (problem := safetensors_problem(path)) is not None:
            raise WeightFileError(f"{path} {problem}; the file is damaged: download or export it again")
