"""The dtypes an export writes its tensors in (`export.dtype`): `auto` keeps the source checkpoint's own
precision (read from its safetensors headers), or one dtype for every floating tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spindle.config import ConfigError

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# safetensors header names of the floating dtypes
_SAFETENSORS_FLOATS = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}


def safetensors_headers(folder: str | Path) -> Iterator[tuple[Path, dict[str, dict[str, object]]]]:
    """(file, header) of every `*.safetensors` file directly in `folder`: the 8-byte length and the
    JSON header only, no tensor data is read."""
    for path in sorted(Path(folder).glob("*.safetensors")):
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        header.pop("__metadata__", None)
        yield path, header


def stored_float_dtypes(folder: str | Path) -> dict[str, torch.dtype]:
    """{tensor name: dtype} of the floating tensors stored in `folder`'s safetensors files."""
    out: dict[str, torch.dtype] = {}
    for _, header in safetensors_headers(folder):
        for name, entry in header.items():
            dtype = _SAFETENSORS_FLOATS.get(str(entry.get("dtype")))
            if dtype is not None:
                out[name] = dtype
    return out


def _dominant(folder: Path) -> torch.dtype | None:
    """The floating dtype holding the most bytes in `folder`'s safetensors (None: no safetensors)."""
    weight: dict[torch.dtype, int] = {}
    for _, header in safetensors_headers(folder):
        for entry in header.values():
            dtype = _SAFETENSORS_FLOATS.get(str(entry.get("dtype")))
            offsets = entry.get("data_offsets")
            if dtype is not None and isinstance(offsets, list):
                weight[dtype] = weight.get(dtype, 0) + int(offsets[1]) - int(offsets[0])
    return max(weight, key=lambda d: weight[d]) if weight else None


def _config_dtype(folder: Path) -> torch.dtype | None:
    """A transformers config's `dtype` / `torch_dtype` (checkpoints stored as .bin carry only that)."""
    config = folder / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    name = data.get("dtype") or data.get("torch_dtype")
    return EXPORT_DTYPES.get(str(name)) if name else None


@dataclass(frozen=True)
class ExportDtypes:
    """The dtype each exported tensor is written in: `by_name` first, else `default`."""

    default: torch.dtype
    by_name: dict[str, torch.dtype] = field(default_factory=dict)

    def of(self, name: str) -> torch.dtype:
        return self.by_name.get(name, self.default)

    def cast(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in its export dtype (floating tensors only; a DTensor converts its local shard)."""
        if not tensor.is_floating_point():
            return tensor
        return tensor.to(self.of(name))

    def cast_all(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self.cast(name, t) for name, t in state_dict.items()}


def check_export_dtype(setting: str) -> None:
    if setting != "auto" and setting not in EXPORT_DTYPES:
        raise ConfigError(f"export.dtype must be 'auto' or one of {sorted(EXPORT_DTYPES)}; got {setting!r}")


def export_dtypes(setting: str, source: str | Path) -> ExportDtypes:
    """`export.dtype` against the input checkpoint's weights folder `source` (a diffusers component
    folder such as `<pipeline>/transformer`, or a transformers model folder).

    "auto": each tensor as the input stored it, new names in the input's dominant floating dtype
    (fp32 when the folder holds no safetensors and no config dtype); otherwise that dtype for all."""
    check_export_dtype(setting)
    if setting != "auto":
        return ExportDtypes(EXPORT_DTYPES[setting])
    source = Path(source)
    default = _dominant(source) or _config_dtype(source) or torch.float32
    return ExportDtypes(default, stored_float_dtypes(source))
