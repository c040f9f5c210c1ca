"""Sharded loading (issue 26.1): build the model on the meta device, parallelize it there, then each
rank reads only the bytes of its own shards from the checkpoint's safetensors, straight into its
DTensor shards, in the parameters' (training) dtype. No rank ever holds the whole model.

    with empty_weights():                    # parameters on meta; buffers real (computed as the
        model = build()                      # library computes them: rotary inv_freq, Wan's rope)
    parallelize(model, mesh, plan)           # SP / EP / checkpointing / compile / FSDP2, on meta
    load_sharded(model, sources, device)     # per rank: its slice of each tensor, one at a time

Per-rank memory during load ~ (model / sharding degree) + one tensor's slice: a block of whole rows (FSDP2's
dim-0 shard, an EP rank's experts) is read with a plain file read at its byte offset into the tensor's
storage, so the file's pages stay in the page cache and are not counted in the process's RSS (a memory
map would keep every page the rank touched resident until the file is closed: half of a bf16 checkpoint
per rank at dp_shard=2); any other region is read through `safe_open(...).get_slice`. `sources` maps each model key to its global
shape and a reader of a region of it: the checkpoint's own tensors (`checkpoint_sources`, diffusers and
transformers sharded indexes both), after the family's `CheckpointAdapter.load_sources` when the model
holds another layout (e.g. per-expert MoE tensors read into the fused `gate_up_proj` / `down_proj`).

Strict (issue 24.3): a parameter missing from the checkpoint, a checkpoint tensor the model does not
have, or a shape that differs is a `CheckpointMismatchError` naming the key, raised from the headers
before any weight is read (`check_checkpoint_keys`). Parameters the checkpoint cannot have (LoRA
adapters: `fresh`) get storage only and are initialised by their owner (spindle.train.lora.init_adapters).
Persistent buffers are read when the checkpoint has them, else keep the library's value.

No diffusers or transformers import here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

# A checkpoint tensor as the model will hold it: (global shape, read(region) -> that region's values).
Region = tuple[slice, ...]
TensorSource = tuple[tuple[int, ...], Callable[[Region], torch.Tensor]]

INDEX_FILES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model: missing, unexpected or of another shape."""


@contextmanager
def empty_weights() -> Iterator[None]:
    """Build models under this: parameters go to the meta device as they are registered (so their
    initialisation costs nothing), buffers stay real, computed as the library computes them."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


class SafetensorsCheckpoint:
    """A folder of safetensors weights (a `*.safetensors.index.json` or every `*.safetensors`): headers
    read up front, bytes on demand."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = next((self.folder / n for n in INDEX_FILES if (self.folder / n).is_file()), None)
        if index is not None:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(self.folder.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"{self.folder} has no *.safetensors weights (sharded loading reads safetensors)")
        self._handles: dict[str, Any] = {}
        self.files: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._offsets: dict[str, tuple[int, torch.dtype]] = {}  # key -> (byte offset of its data, dtype)
        for name in files:
            path = self.folder / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is listed in {index} but missing")
            handle: Any = safe_open(str(path), framework="pt")
            self._handles[name] = handle
            for key in handle.keys():
                self.files[key] = name
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())
            self._offsets.update(_data_offsets(path))

    def read(self, key: str, region: Region) -> torch.Tensor:
        """The values of `region` of tensor `key` (only those bytes are read)."""
        if any(s.stop - s.start <= 0 for s in region):  # an empty shard (uneven split): nothing to read
            sl = self._handles[self.files[key]].get_slice(key)
            return torch.empty([s.stop - s.start for s in region], dtype=_DTYPES.get(sl.get_dtype(), torch.float32))
        rows = _row_block(region, self.shapes[key])
        if rows is not None and key in self._offsets:
            return self._read_rows(key, rows)
        tensor: torch.Tensor = self._handles[self.files[key]].get_slice(key)[region]
        return tensor

    def _read_rows(self, key: str, rows: slice) -> torch.Tensor:
        shape = self.shapes[key]
        start, dtype = self._offsets[key]
        row_bytes = dtype.itemsize * int(torch.Size(shape[1:]).numel())
        out = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=dtype)
        with open(self.folder / self.files[key], "rb", buffering=0) as f:
            f.seek(start + rows.start * row_bytes)
            view = memoryview(out.view(torch.uint8).numpy().reshape(-1))  # type: ignore[arg-type]  # ndarray is a buffer
            got = 0
            while got < len(view):  # readinto may return fewer bytes than asked
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{self.folder / self.files[key]} ended inside tensor {key!r}; the file is truncated")
                got += n
        return out

    def sources(self) -> dict[str, TensorSource]:
        """{key: (shape, reader)} of every tensor in the checkpoint."""
        return {key: (shape, _reader(self, key)) for key, shape in self.shapes.items()}


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _data_offsets(path: Path) -> dict[str, tuple[int, torch.dtype]]:
    """{key: (absolute byte offset of its data, dtype)} from a safetensors header (floating dtypes only)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {
        key: (8 + length + info["data_offsets"][0], _DTYPES[info["dtype"]])
        for key, info in header.items()
        if key != "__metadata__" and info["dtype"] in _DTYPES
    }


def _row_block(region: Region, shape: tuple[int, ...]) -> slice | None:
    """`region`'s rows when it is a block of whole rows (contiguous bytes in a row-major file), else None."""
    if not shape or len(region) != len(shape) or any(r.step not in (None, 1) for r in region):
        return None
    if any((r.start or 0, r.stop) != (0, n) for r, n in zip(region[1:], shape[1:], strict=True)):
        return None
    return slice(region[0].start or 0, shape[0] if region[0].stop is None else region[0].stop)


def _reader(checkpoint: SafetensorsCheckpoint, key: str) -> Callable[[Region], torch.Tensor]:
    return lambda region: checkpoint.read(key, region)


def checkpoint_key(name: str) -> str:
    """The checkpoint key of a model parameter: PEFT (LoRA) moves a wrapped layer's own weights under
    `base_layer.`, which the base checkpoint does not have (nested, once per wrapped parameter of a
    module: PEFT's `ParamWrapper`s of fused experts)."""
    return re.sub(r"(\.base_layer)+\.", ".", name)


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{checkpoint key: global shape} of the model's parameters (tied ones once), meta or sharded alike."""
    return {checkpoint_key(name): tuple(p.shape) for name, p in model.named_parameters()}


def _aliases(model: nn.Module) -> set[str]:
    """Second names of tied parameters (lm_head.weight tied to the embeddings) and buffer names: a
    checkpoint may hold them, the model reads them through the first name or keeps its own value."""
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {checkpoint_key(n) for n in tied} | {checkpoint_key(n) for n, _ in model.named_buffers()}


def check_checkpoint_keys(
    model: nn.Module,
    sources: dict[str, tuple[tuple[int, ...], Any]] | dict[str, tuple[int, ...]],
    where: str,
    keep: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Raise `CheckpointMismatchError` naming the first missing, unexpected or mismatched tensor.

    `sources`: {checkpoint key: shape or (shape, reader)}; `keep`: parameters not read from the
    checkpoint (adapters); the model's `_keys_to_ignore_on_load_unexpected` patterns (a transformers and
    diffusers convention) are honoured.
    """
    shapes = {k: (v[0] if v and isinstance(v[0], tuple) else v) for k, v in sources.items()}
    expected = {k: s for k, s in model_shapes(model).items() if k not in keep}
    ignore = [str(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    missing = sorted(k for k in expected if k not in shapes)
    unexpected = sorted(
        k
        for k in shapes
        if k not in expected and k not in keep and k not in _aliases(model) and not _ignored(k, ignore)
    )
    mismatched = sorted(k for k in expected if k in shapes and tuple(shapes[k]) != expected[k])
    model_name = type(model).__name__
    if missing:
        raise CheckpointMismatchError(
            f"{where}: tensor {missing[0]} of {model_name} is missing from the checkpoint"
            + _more(missing)
            + "; it would be left uninitialised. Does config.json match the weights (layer counts, sizes)?"
        )
    if mismatched:
        key = mismatched[0]
        raise CheckpointMismatchError(
            f"{where}: tensor {key} has shape {list(shapes[key])} in the checkpoint but {list(expected[key])} in "
            f"{model_name}" + _more(mismatched) + "; the checkpoint does not match its config.json"
        )
    if unexpected:
        raise CheckpointMismatchError(
            f"{where}: checkpoint tensor {unexpected[0]} is not a parameter of {model_name}"
            + _more(unexpected)
            + "; the weights belong to another model or config.json (or model.family) is wrong"
        )


def _ignored(key: str, patterns: list[str]) -> bool:
    import re

    return any(re.search(p, key) for p in patterns)


def _more(keys: list[str]) -> str:
    return f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """This rank's piece of `t` (its DTensor shard, or the whole plain tensor) and where it lies in the
    global tensor."""
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return t, tuple(slice(0, n) for n in t.shape)


def materialize(model: nn.Module, device: torch.device) -> set[str]:
    """Give every meta parameter real (uninitialised) storage of its local shard on `device`, keeping
    ties (one new tensor per tied parameter) and sharding (DTensor stays DTensor); -> the names of the
    parameters that were on meta. Real plain parameters and buffers (host-initialised adapters, the
    library's buffers) move to `device` if elsewhere (FSDP2 moved those it manages already)."""
    new: dict[int, nn.Parameter] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    created: set[str] = set()
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is None or (not param.is_meta and (param.device == device or isinstance(param, DTensor))):
                continue
            if id(param) not in new:
                data = torch.empty_like(param.data, device=device) if param.is_meta else param.data.to(device)
                new[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
                if param.is_meta:
                    created.add(names.get(id(param), pname))
            module._parameters[pname] = new[id(param)]
        for bname, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device and not isinstance(buf, DTensor):
                module._buffers[bname] = buf.to(device)
    return created


@torch.no_grad()
def load_sharded(
    model: nn.Module,
    sources: dict[str, TensorSource],
    device: torch.device,
    where: str,
    fresh: Callable[[str], bool] | None = None,
) -> None:
    """Fill the model's meta parameters with this rank's slices of `sources`, one tensor at a time;
    persistent buffers the checkpoint holds are read too. Strict (`check_checkpoint_keys`). Parameters
    for which `fresh(name)` is true (adapters) are not in the checkpoint: they get storage only, for
    the caller to initialise."""
    if not any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__}: sharded loading expects a model built on the meta device (empty_weights)"
        )
    is_fresh = fresh or (lambda name: False)
    keep = {checkpoint_key(n) for n, p in model.named_parameters() if not p.is_meta or is_fresh(n)}
    check_checkpoint_keys(model, sources, where, keep)
    for name in sorted(materialize(model, device)):
        if not is_fresh(name):
            _fill(model.get_parameter(name), sources[checkpoint_key(name)])
    persistent = set(model.state_dict())
    for name, buf in model.named_buffers():
        if checkpoint_key(name) in sources and name in persistent:
            _fill(buf, sources[checkpoint_key(name)])


def _fill(t: torch.Tensor, source: TensorSource) -> None:
    local, region = local_region(t)
    local.copy_(source[1](region))
