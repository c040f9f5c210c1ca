"""Resumable sharded checkpoints (torch.distributed.checkpoint) and export to a diffusers folder.

Layout of a run's output dir:
    checkpoints/step-000100/   DCP shards of model + optimizer, trainer_state.json, rng-rank*.pt
    checkpoints/step-000100.tmp/  (while being written; never read)
    export/                    a full diffusers pipeline folder (original components + trained transformer)

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

STEP_DIR = re.compile(r"^step-(\d+)$")
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


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """`none` -> None, `auto` -> latest complete checkpoint (or None), else an explicit folder."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
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
    """Collective: every rank calls it. Returns the final checkpoint folder."""
    final = checkpoint_root(output_dir) / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
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
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: gather the full (unsharded) model state dict on CPU; meaningful on rank 0."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # with full_state_dict=True every value is a plain tensor (no DTensor, no nested dicts)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def read_checkpoint_model(path: Path, template: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Read a checkpoint's model weights into a plain state dict shaped like `template` (1 process)."""
    sd = {k: v.detach().clone() for k, v in template.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=str(path))
    return sd


def export_pipeline(source_root: str | Path, state_dict: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write a diffusers pipeline folder: every component of `source_root`, with the trained transformer.

    The transformer is rebuilt from its own diffusers config and saved with diffusers' `save_pretrained`,
    so `config.json` carries only diffusers keys and stock diffusers loads the folder with no Spindle code.
    Written to `<out>.tmp` first, then renamed.
    """
    import diffusers

    source_root, out = Path(source_root), Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source_root, tmp, ignore=shutil.ignore_patterns("transformer"))
    config = json.loads((source_root / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    model = cls.from_config(cls.load_config(source_root / "transformer"))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"trained weights do not fit {cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.save_pretrained(tmp / "transformer", safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_checkpoint_arg(path: str | Path) -> Path:
    """Accept a checkpoint folder, or a run's output dir (-> its latest checkpoint)."""
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise FileNotFoundError(
        f"{path} is neither a Spindle checkpoint (no {TRAINER_STATE}) nor a run folder with checkpoints/step-N"
    )


def export_checkpoint(checkpoint: Path, model_path: Path, out: Path) -> Path:
    """Single-process export of a (possibly sharded) DCP checkpoint to a diffusers folder."""
    from spindle.models.base import load_transformer

    if not (model_path / "model_index.json").is_file():
        raise FileNotFoundError(f"base model {model_path} has no model_index.json; pass --model PATH")
    template = load_transformer(model_path)
    return export_pipeline(model_path, read_checkpoint_model(checkpoint, template), out)
