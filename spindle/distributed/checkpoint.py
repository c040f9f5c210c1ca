"""Resumable sharded checkpoints (torch.distributed.checkpoint); exports are the tasks' (spindle.train.tasks).

Layout of a run's output dir:
    checkpoints/step-000100/   DCP shards of model + optimizer, trainer_state.json, rng-rank*.pt
    checkpoints/step-000100.tmp/  (while being written; never read)
    export/                    the task's export (a diffusers pipeline folder, a transformers folder)

A checkpoint is written to `<name>.tmp` and renamed only when every rank has finished, so a crash or
Ctrl-C mid-save leaves the previous checkpoint untouched and `resume=auto` never picks a partial one.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from spindle.distributed.mesh import barrier, is_main_process

# Checkpoints hold what trains (every parameter with requires_grad, plus buffers) and the optimizer
# state; a LoRA run's frozen base weights are read from the base model again on resume.
_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
# Setting them back: the frozen ones are absent on purpose (not strict); every trainable one was
# requested from DCP, whose load fails on a key the checkpoint lacks, so nothing goes missing silently.
_SET_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dirname(step: int) -> str:
    """`step-000100`: the name of a step's folder, for checkpoints and validation samples alike (sorts by step)."""
    return f"step-{step:06d}"


TRAINER_STATE = "trainer_state.json"


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (no .tmp), oldest first."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / TRAINER_STATE).is_file()]


def checkpoint_step(path: Path) -> int:
    """The step a complete checkpoint folder holds."""
    return int(json.loads((Path(path) / TRAINER_STATE).read_text())["step"])


def _refuse_partial(path: Path) -> None:
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(
            f"{path} is a partial checkpoint (a save that did not finish); resume from a complete "
            f"step-N folder next to it, or use checkpoint.resume=auto"
        )


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """`none` -> None, `auto` -> latest complete checkpoint (or None), else an explicit folder."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    _refuse_partial(path)
    if not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a complete Spindle checkpoint (no {TRAINER_STATE}); "
            f"use 'auto', 'none' or a folder like {checkpoint_root(output_dir)}/step-000100"
        )
    return path


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder.

    Partial folders (`*.tmp`) left by a save that crashed or was killed are removed first: they are
    never resumed from (`list_checkpoints` ignores them) and would otherwise pile up.
    """
    final = checkpoint_root(output_dir) / step_dirname(step)
    tmp = final.with_name(final.name + ".tmp")
    if is_main_process():
        for stale in checkpoint_root(output_dir).glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # Frozen parameters (a LoRA run's base weights) are not saved: they come from the base checkpoint.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(_rng_state(), tmp / f"rng-rank{rank}.pt")
    barrier()
    if is_main_process():
        (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, **trainer_state}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective. Restores model + optimizer in place (any world size); returns trainer_state."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_SET_TRAINABLE
    )
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = path / f"rng-rank{rank}.pt"
    if not rng_file.is_file():  # resumed on more ranks than saved: new ranks take rank 0's stream
        rng_file = path / "rng-rank0.pt"
    rng = torch.load(rng_file, weights_only=False)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    trainer_state: dict[str, Any] = json.loads((path / TRAINER_STATE).read_text())
    return trainer_state


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: gather the full (unsharded) model state dict on CPU; meaningful on rank 0.
    `trainable_only`: leave out frozen parameters (a LoRA run gathers only its adapters)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    # with full_state_dict=True every value is a plain tensor (no DTensor, no nested dicts)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


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


def save_hf_safetensors(state_dict: dict[str, torch.Tensor], out: str | Path, max_shard_bytes: int = 5 << 30) -> None:
    """Collective: write `state_dict` (plain tensors or FSDP2 DTensors) as Hugging Face sharded safetensors.

    `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json` in `out`, each file at most
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
    dcp.save(state_dict, storage_writer=writer)
    barrier()
    if is_main_process():
        shutil.rmtree(out / SHARDED_DIR_NAME, ignore_errors=True)  # the per-rank pieces, now consolidated


def read_checkpoint_model(path: Path, template: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Read a checkpoint's model weights into a plain state dict shaped like `template` (1 process)."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    # a LoRA checkpoint holds only the adapters: the template's other tensors stay the base weights
    sd = {k: v.detach().clone() for k, v in template.state_dict().items()}
    dcp.load({"model": {k: v for k, v in sd.items() if f"model.{k}" in saved}}, checkpoint_id=str(path))
    return sd


def resolve_checkpoint_arg(path: str | Path) -> Path:
    """Accept a checkpoint folder, or a run's output dir (-> its latest checkpoint)."""
    path = Path(path)
    _refuse_partial(path)
    if (path / TRAINER_STATE).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise FileNotFoundError(
        f"{path} is neither a Spindle checkpoint (no {TRAINER_STATE}) nor a run folder with checkpoints/step-N"
    )
