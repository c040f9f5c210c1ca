"""Hugging Face safetensors sets written from (possibly sharded) state dicts: every rank writes its own
parameter shards through DCP's Hugging Face writer and rank 0 consolidates them (the model is never gathered
whole), tensors appended a group at a time, and the index/file renames diffusers' and transformers' layouts use."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from spindle.distributed.integrity import DiskFullError, is_disk_full
from spindle.distributed.mesh import barrier, is_main_process


def shard_plan(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> dict[str, int]:
    """{fqn: 1-based safetensors file index}: tensors in order, a new file when the next would overflow."""
    plan: dict[str, int] = {}
    index, used = 1, 0
    for fqn, tensor in state_dict.items():
        size = tensor.numel() * tensor.element_size()  # a DTensor's numel is the full tensor's
        if used and used + size > max_shard_bytes:
            index, used = index + 1, 0
        plan[fqn] = index
        used += size
    return plan


def save_hf_safetensors(
    state_dict: dict[str, torch.Tensor],
    out: str | Path,
    max_shard_bytes: int = 5 << 30,
    weights_name: str = "model.safetensors",
) -> None:
    """Collective: write `state_dict` (plain tensors or FSDP2 DTensors) as Hugging Face sharded safetensors.

    `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` in `out` (`weights_name`
    renames them: diffusers' `diffusion_pytorch_model.safetensors`), each file at most
    `max_shard_bytes` (one bigger tensor gets a file of its own). Every rank writes only its own
    parameter shards (DCP's `HuggingFaceStorageWriter`, `save_distributed=True`) and rank 0 then
    consolidates the per-rank files into the final ones tensor by tensor; the whole model is never
    gathered in one process's memory. Works on one process (no process group) too.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import SHARDED_DIR_NAME

    out = Path(out)
    if is_main_process():
        out.mkdir(parents=True, exist_ok=True)
    barrier()
    writer = HuggingFaceStorageWriter(
        path=str(out),
        fqn_to_index_mapping=shard_plan(state_dict, max_shard_bytes),
        save_distributed=True,
        enable_consolidation=True,
    )
    try:
        dcp.save(state_dict, storage_writer=writer)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not is_disk_full(e):
            raise
        raise DiskFullError(
            f"No space left on device while exporting to {out} (the export there is incomplete; the checkpoints "
            "are intact); free space, then export again with `spindle export RUN --out DIR`",
            out,
        ) from e
    barrier()
    if is_main_process():
        shutil.rmtree(out / SHARDED_DIR_NAME, ignore_errors=True)  # the per-rank pieces, now consolidated
        if weights_name != "model.safetensors":
            rename_weight_files(out, "model.safetensors", weights_name)
    barrier()


def append_safetensors(
    folder: Path,
    groups: Iterator[dict[str, torch.Tensor]],
    max_shard_bytes: int = 5 << 30,
    name: str = "model.safetensors",
) -> None:
    """Collective: add the tensors `groups` yields (each rank iterates it: producing a group may be a
    collective, e.g. gathering one expert tensor) to the sharded set `save_hf_safetensors` wrote in `folder`,
    as more files written by the main process (the last existing file rewritten with the first of them), at
    most one file's tensors in memory; then every file is renumbered `<stem>-0000i-of-0000N.safetensors` and the index rewritten."""
    from safetensors.torch import save_file

    stem = name.removesuffix(".safetensors")
    index_path = folder / f"{name}.index.json"
    main = is_main_process()
    index = json.loads(index_path.read_text()) if main else {}
    files = sorted(set(index.get("weight_map", {}).values()))
    added: list[dict[str, torch.Tensor]] = [{}]
    if main and files:  # the last file is filled up first (a small model stays one file, as save_pretrained writes it)
        from safetensors.torch import load_file

        last = files.pop()
        added[-1] = load_file(folder / last)
        (folder / last).unlink()
        index["metadata"]["total_size"] -= sum(t.numel() * t.element_size() for t in added[-1].values())

    def flush() -> None:
        if added[-1]:
            part = f"{stem}-appended-{len(added):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in added[-1].items()}, str(folder / part), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(added[-1], part))
            index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + sum(
                t.numel() * t.element_size() for t in added[-1].values()
            )
            files.append(part)
            added.append({})

    for group in groups:
        if not main:
            continue
        size = sum(t.numel() * t.element_size() for t in group.values())
        used = sum(t.numel() * t.element_size() for t in added[-1].values())
        if used and used + size > max_shard_bytes:
            flush()
        added[-1].update(group)
    if main:
        flush()
        renamed = {f: f"{stem}-{i:05d}-of-{len(files):05d}.safetensors" for i, f in enumerate(files, 1)}
        for f, new in renamed.items():  # no clash: the appended names differ from every final name
            (folder / f).rename(folder / f"{new}.renaming")
        for new in renamed.values():
            (folder / f"{new}.renaming").rename(folder / new)
        index["weight_map"] = {k: renamed[f] for k, f in index["weight_map"].items()}
        index_path.write_text(json.dumps(index, indent=2))
    barrier()


def rename_weight_files(folder: Path, old: str, new: str) -> None:
    """Rename a sharded safetensors set (`<old stem>-0000i-of-0000n.safetensors` + its index) to `new`'s
    stem, rewriting the index's weight map (DCP's writer names them after transformers' convention).
    A set of one file becomes `new` itself with no index, as `save_pretrained` writes a small model."""
    old_stem, new_stem = old.removesuffix(".safetensors"), new.removesuffix(".safetensors")
    index_path = folder / f"{old}.index.json"
    index = json.loads(index_path.read_text())
    files = set(index["weight_map"].values())
    if len(files) == 1:
        (folder / files.pop()).rename(folder / new)
        index_path.unlink()
        return
    renamed = {f: new_stem + f.removeprefix(old_stem) for f in files}
    for src, dst in renamed.items():
        (folder / src).rename(folder / dst)
    index["weight_map"] = {k: renamed[f] for k, f in index["weight_map"].items()}
    (folder / f"{new}.index.json").write_text(json.dumps(index, indent=2))
    index_path.unlink()
