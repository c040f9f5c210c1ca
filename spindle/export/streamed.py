"""Write a model's weights from a saved checkpoint without building the model.

`spindle export` runs on one process, often after the job, on a machine smaller than the one that
trained. Building the model and reading the checkpoint into it held the base weights and a trained
copy at once (2x the fp32 model); here the expected tensors come from a meta-device model, and the
weights are read a shard at a time: each tensor from the checkpoint (DCP reads only its byte ranges),
or, where the checkpoint does not hold it (a frozen or LoRA run), from the base model's safetensors.
At most one output shard is in memory. The files are Hugging Face sharded safetensors with an index,
the layout `save_pretrained` writes for a model of that size, so stock libraries load them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from spindle.distributed import checkpoint as ckpt
from spindle.export.dtypes import ExportDtypes

Reader = Callable[[list[str]], dict[str, torch.Tensor]]


class SafetensorsFolder:
    """Tensors of a model folder's safetensors (one file or an indexed set), read by name on demand."""

    def __init__(self, folder: Path) -> None:
        self.where: dict[str, Path] = {}
        for index in folder.glob("*.safetensors.index.json"):
            for name, file in json.loads(index.read_text())["weight_map"].items():
                self.where[name] = folder / file
        if not self.where:
            from safetensors import safe_open

            for file in sorted(folder.glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    self.where.update(dict.fromkeys(f.keys(), file))

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        if missing := [n for n in names if n not in self.where]:
            raise KeyError(f"the base weights hold no tensor {missing[0]!r} ({len(missing)} missing)")
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.where[n], []).append(n)
        for file, wanted in by_file.items():
            with safe_open(str(file), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in wanted})
        return out


def checkpoint_then_base(checkpoint: Path, base: Path) -> Reader:
    """A reader that takes each tensor from `checkpoint` where it was saved, else from the base weights."""
    saved = set(ckpt.saved_model_tensors(checkpoint))
    base_weights = SafetensorsFolder(base)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        trained = [n for n in names if n in saved]
        out = ckpt.read_model_tensors(checkpoint, trained) if trained else {}
        if rest := [n for n in names if n not in saved]:
            out.update(base_weights.read(rest))
        return {n: out[n] for n in names}

    return read


def _plan(expected: dict[str, torch.Tensor], dtypes: ExportDtypes, max_shard_bytes: int) -> Iterator[list[str]]:
    """Names grouped into shards of at most `max_shard_bytes` in their export dtype (a bigger tensor alone)."""
    shard: list[str] = []
    used = 0
    for name, t in expected.items():
        dtype = dtypes.of(name) if t.is_floating_point() else t.dtype
        size = t.numel() * dtype.itemsize
        if shard and used + size > max_shard_bytes:
            yield shard
            shard, used = [], 0
        shard.append(name)
        used += size
    if shard:
        yield shard


def write_streamed(
    expected: dict[str, torch.Tensor],
    read: Reader,
    out: Path,
    weights_name: str,
    dtypes: ExportDtypes,
    max_shard_bytes: int = 5 << 30,
    single_file: bool = True,
) -> None:
    """Write the tensors named (and shaped) by `expected` (meta tensors are fine) as `out/<stem>-0000i-of-
    0000n.safetensors` + `<weights_name>.index.json` (one shard and `single_file`: `out/<weights_name>`,
    as diffusers' `save_pretrained` writes it), reading each shard's tensors with `read`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    stem = weights_name.removesuffix(".safetensors")
    shards = list(_plan(expected, dtypes, max_shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, 1):
        tensors = read(names)
        for name in names:
            if tensors[name].shape != expected[name].shape:
                raise RuntimeError(
                    f"{name}: the checkpoint holds shape {tuple(tensors[name].shape)}, the model expects "
                    f"{tuple(expected[name].shape)}; was the run trained from another base model? pass --model PATH"
                )
        cast = {n: dtypes.cast(n, tensors[n]).contiguous() for n in names}
        # one shard: the single unindexed file `save_pretrained` writes for a model of that size
        file = weights_name if single_file and len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(cast, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        total += sum(t.numel() * t.element_size() for t in cast.values())
        del tensors, cast  # one shard in memory at a time
    if single_file and len(shards) == 1:
        return
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / f"{weights_name}.index.json").write_text(json.dumps(index, indent=2))
