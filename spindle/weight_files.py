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
            # the length itself is not shown: in a file that is no safetensors it is 8 bytes of its content
            return f"declares a header longer than the file ({size} bytes): it is not a safetensors file, or damaged"
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError) as e:
            return f"has an unreadable header ({e})"
    if not isinstance(header, dict):
        return "has a header that is not a JSON object"
    ends = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if (problem := _entry_problem(entry)) is not None:
            return f"has a damaged header entry for tensor {name!r}: {problem}"
        ends.append(entry["data_offsets"][1])
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        return f"is truncated: {size} bytes, its header needs {needed}"
    return None


# bytes per element of safetensors' dtype names
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(entry: object) -> str | None:
    """What is wrong with one tensor's header entry ({"dtype", "shape", "data_offsets"}), or None."""
    if not isinstance(entry, dict):
        return f"not an object ({type(entry).__name__})"
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        return f"no {', '.join(missing)}"
    offsets, shape, dtype = entry["data_offsets"], entry["shape"], entry["dtype"]
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        return f"data_offsets {offsets!r} is not two byte offsets"
    if offsets[0] > offsets[1]:
        return f"data_offsets {offsets} ends before it begins"
    if not (isinstance(shape, list) and all(map(_is_count, shape))):
        return f"shape {shape!r} is not a list of sizes"
    if dtype in _ITEMSIZE:
        count = 1
        for n in shape:
            count *= n
        if (size := count * _ITEMSIZE[dtype]) != offsets[1] - offsets[0]:
            return f"{dtype} {shape} is {size} bytes, data_offsets {offsets} hold {offsets[1] - offsets[0]}"
    return None


def check_weight_files(folder: str | Path) -> None:
    """Raise WeightFileError naming the first `*.safetensors` under `folder` whose header is damaged."""
    root = Path(folder)
    files = sorted(root.rglob("*.safetensors")) if root.is_dir() else [root] if root.suffix == ".safetensors" else []
    for path in files:
        if (problem := safetensors_problem(path)) is not None:
            raise WeightFileError(f"{path} {problem}; the file is damaged: download or export it again")
