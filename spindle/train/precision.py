"""Storage dtypes: what an export is written in (`export.dtype`) and what frozen weights are kept in
(`train.frozen_dtype`).

Training keeps fp32 master weights whatever the checkpoint's dtype; an export goes back to the
checkpoint's own precision, tensor by tensor: every tensor is written in the dtype the same name has
in the input checkpoint's safetensors (so a bf16 Wan whose `_keep_in_fp32_modules` are stored in
fp32 comes back exactly so), and a name the input lacks (LoRA adapters) takes the input's dominant
floating dtype. An explicit `export.dtype` writes every floating tensor in that dtype. Integer and
bool tensors are never converted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
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


def frozen_dtype(setting: str, precision: str) -> torch.dtype:
    """`train.frozen_dtype` against the run's resolved mixed precision ("bf16" / "no"): the dtype frozen
    parameters are stored in. auto: the compute precision (or the checkpoint's own narrower dtype
    under FSDP2, `frozen_storage`). bfloat16 without bf16 compute would feed
    bf16 weights to fp32 matmuls: refused, naming both keys."""
    if setting == "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    if setting == "bfloat16" and precision != "bf16":
        raise ConfigError(
            "train.frozen_dtype: bfloat16 stores frozen weights for bf16 compute, but this run computes in fp32 "
            f"(train.mixed_precision resolves to {precision!r}); set train.mixed_precision: bf16 or "
            "train.frozen_dtype: auto"
        )
    if setting not in ("float32", "bfloat16"):
        raise ConfigError(f"train.frozen_dtype must be auto, float32 or bfloat16; got {setting!r}")
    return EXPORT_DTYPES[setting]


def frozen_storage(
    setting: str, precision: str, *, upcast_at_gather: bool, stored: Mapping[str, torch.dtype]
) -> Callable[[str], torch.dtype]:
    """Per frozen parameter name (the model's, `base_layer.` included), the dtype it is stored in.

    `frozen_dtype(setting, precision)` for every parameter, except under `auto` with fp32 compute where
    FSDP2 shards the model (`upcast_at_gather`): a parameter the checkpoint stores in a narrower float
    (`stored`: {checkpoint name: dtype}, e.g. a bf16 Wan) keeps that dtype. Nothing is lost (the values
    are the checkpoint's), FSDP2's `param_dtype=float32` upcasts each block's weights at its all-gather
    (spindle.distributed.fsdp.mp_policy), so the step computes on exactly the fp32 numbers the fp32
    path would, while each rank's resident shard of the frozen base is half the size. Without FSDP2
    (one process) a bf16 weight would meet fp32 activations: fp32 there."""
    base = frozen_dtype(setting, precision)
    if setting != "auto" or base != torch.float32 or not upcast_at_gather:
        return lambda name: base

    from spindle.distributed.sharded_load import checkpoint_key

    def dtype(name: str) -> torch.dtype:
        narrow = stored.get(checkpoint_key(name))
        return narrow if narrow in (torch.bfloat16, torch.float16) else base

    return dtype


def store_frozen(model: torch.nn.Module, dtype: torch.dtype | Callable[[str], torch.dtype]) -> int:
    """Store `model`'s frozen floating parameters (requires_grad False: a LoRA run's base weights,
    frozen towers) in `dtype` (or `dtype(name)`), in place, before parallelisation (works on meta
    tensors too). Trainable parameters keep fp32 master weights. Modules the model keeps in fp32
    (diffusers / transformers `_keep_in_fp32_modules`: norms, time embedders, modulation tables) are
    left alone, as a from_pretrained in that dtype would. -> the number of parameters converted."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    converted = 0
    for name, param in model.named_parameters():
        target = dtype(name) if callable(dtype) else dtype
        if param.requires_grad or not param.is_floating_point() or param.dtype == target:
            continue
        if keep & set(name.split(".")):
            continue
        param.data = param.data.to(target)
        converted += 1
    return converted
