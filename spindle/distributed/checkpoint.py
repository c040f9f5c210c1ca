"""Resumable sharded checkpoints (torch.distributed.checkpoint); exports are the tasks' (spindle.train.tasks).

Layout of a run's output dir:
    checkpoints/step-000100/   DCP shards of model + optimizer, trainer_state.json, rng-rank*.pt
    checkpoints/step-000100.tmp/  (while being written; never read)
    export/                    the task's export (a diffusers pipeline folder, a transformers folder)

A checkpoint is written to `<name>.tmp` and renamed only when every rank has finished, so a crash or
Ctrl-C mid-save leaves the previous checkpoint untouched and `resume=auto` never picks a partial one.
Every file's size and CRC-32 go into `manifest.json`, written last; files and folder are fsync'ed
before the rename (`spindle.distributed.integrity`). Resume verifies the checkpoint it loads:
`resume=auto` skips a damaged one (naming it and the file, and moving it aside to `step-N.damaged`)
for the newest one that verifies; an explicit `checkpoint.resume=PATH` that is damaged is an error.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
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

from spindle.distributed.integrity import (
    MANIFEST,
    CheckpointError,
    DiskFullError,
    ManifestFileSystemWriter,
    fsync_dir,
    is_disk_full,
    read_manifest,
    verify_files,
    write_durably,
    write_manifest,
)
from spindle.distributed.mesh import barrier, is_main_process

log = logging.getLogger("spindle.train")

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
    """Complete checkpoints (renamed from .tmp: a manifest or, written by an older Spindle, a
    trainer_state.json), oldest first. Whether their files are intact is `verify_checkpoint`'s job."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / MANIFEST).is_file() or (p / TRAINER_STATE).is_file()]


def read_trainer_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json; a damaged one is a CheckpointError naming the file."""
    file = Path(path) / TRAINER_STATE
    try:
        state = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing; the checkpoint {path} is incomplete") from None
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}); the checkpoint {path} is damaged") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{file} has no integer 'step'; the checkpoint {path} is damaged")
    return state


def checkpoint_step(path: Path) -> int:
    """The step a complete checkpoint folder holds."""
    return int(read_trainer_state(path)["step"])


def verify_checkpoint(path: Path) -> list[str]:
    """Collective: what is wrong with a checkpoint folder (each message names a file); [] when intact.

    Every rank checks its share of the files (each is read once in all), and all ranks get every
    problem, so they agree on whether to use it. A checkpoint without a manifest (written before
    Spindle recorded checksums) is only checked for a readable trainer_state.json, with a warning.
    """
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    if manifest is None:
        if is_main_process():
            log.warning("%s has no %s (an older Spindle wrote it): its files are not verified", path, MANIFEST)
        try:
            read_trainer_state(path)
        except CheckpointError as e:
            return [str(e)]
        return []
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = verify_files(path, sorted(manifest)[rank::world], manifest)
    if world > 1:
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, problems)
        problems = [p for part in gathered for p in (part or [])]
    if not problems and TRAINER_STATE not in manifest:
        problems = [f"{path / MANIFEST} does not list {TRAINER_STATE}; the checkpoint is damaged"]
    return problems


def _refuse_partial(path: Path) -> None:
    if path.name.endswith(".tmp"):
        raise FileNotFoundError(
            f"{path} is a partial checkpoint (a save that did not finish); resume from a complete "
            f"step-N folder next to it, or use checkpoint.resume=auto"
        )


def resolve_resume(resume: str, output_dir: str | Path) -> Path | None:
    """Collective. `none` -> None, `auto` (or `force`: the same checkpoint; the trainer then skips the
    same-run check) -> the newest checkpoint that verifies (or None when there is none), else an
    explicit folder, which must verify.

    `auto` skips a damaged checkpoint with a warning naming it and the damaged file, and moves it
    aside (`step-N.damaged`): kept for inspection, but no longer listed, resumed or counted by
    `keep_last`. Only damaged checkpoints and no intact one is an error (nothing would be resumed).
    """
    if resume == "none":
        return None
    if resume in ("auto", "force"):
        damaged: list[str] = []
        for path in reversed(list_checkpoints(output_dir)):
            problems = verify_checkpoint(path)
            if not problems:
                if damaged and is_main_process():
                    log.warning("resuming from %s, the newest intact checkpoint", path)
                return path
            aside = _move_aside(path)
            damaged.append(f"{path.name}: {problems[0]}")
            if is_main_process():  # every rank knows; one says it
                log.warning(
                    "checkpoint %s is damaged: %s; skipping it (moved to %s) and trying the one before",
                    path,
                    "; ".join(problems),
                    aside,
                )
        if damaged:
            raise CheckpointError(
                f"every checkpoint in {checkpoint_root(output_dir)} is damaged ({'; '.join(damaged)}); "
                "resume one of them by hand after repairing it, or start over with checkpoint.resume=none"
            )
        return None
    path = Path(resume)
    _refuse_partial(path)
    if not (path / MANIFEST).is_file() and not (path / TRAINER_STATE).is_file():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a complete Spindle checkpoint (no {MANIFEST}); "
            f"use 'auto', 'force', 'none' or a folder like {checkpoint_root(output_dir)}/step-000100"
        )
    if problems := verify_checkpoint(path):
        raise CheckpointError(
            f"checkpoint.resume={resume!r} is damaged: {'; '.join(problems)}; resume from an earlier "
            "checkpoint, or use checkpoint.resume=auto to take the newest intact one"
        )
    return path


def _move_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to `step-N.damaged` (rank 0; every rank gets the same name)."""
    aside = path.with_name(path.name + ".damaged")
    n = 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{n}")
    barrier()
    if is_main_process():
        path.rename(aside)
    barrier()
    return aside


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
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint folder. `extra`: more sharded state
    saved with the model by DCP, by namespace (`{"ema": {fqn: tensor}}`, `spindle.train.ema`).

    Partial folders (`*.tmp`, `*.deleting`) left by a save or a prune that crashed or was killed are
    removed first: they are never resumed from (`list_checkpoints` ignores them) and would otherwise
    pile up. A disk that fills up during the save raises `DiskFullError` ("No space left on device",
    the path) after removing the partial folder; the previous checkpoint is untouched.
    """
    root = checkpoint_root(output_dir)
    final = root / step_dirname(step)
    tmp = final.with_name(final.name + ".tmp")
    if is_main_process():
        for stale in [*root.glob("step-*.tmp"), *root.glob("step-*.deleting")]:
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    writer = ManifestFileSystemWriter(tmp)
    try:
        _write_checkpoint(tmp, step, model, optimizer, trainer_state, writer, extra or {})
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not (is_disk_full(e) or (writer.write_error is not None and is_disk_full(writer.write_error))):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial save took
        previous = list_checkpoints(output_dir)
        kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "there is no earlier checkpoint"
        raise DiskFullError(
            f"No space left on device while saving checkpoint step {step} to {tmp} (the partial folder was "
            f"removed; {kept}); free space, then run again with checkpoint.resume=auto",
            tmp,
        ) from e
    barrier()
    if is_main_process():
        replaced = final.with_name(final.name + ".deleting")
        if final.exists():  # re-saving a step: never leave a half-deleted folder under the final name
            final.rename(replaced)
        tmp.rename(final)
        fsync_dir(root)
        shutil.rmtree(replaced, ignore_errors=True)
        _prune(list_checkpoints(output_dir), keep=final, keep_last=keep_last)
    barrier()
    return final


def _write_checkpoint(
    tmp: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    writer: ManifestFileSystemWriter,
    extra: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Every rank writes its shards and RNG state; rank 0 adds trainer_state.json and, last, the
    manifest of every rank's files; all of it fsync'ed."""
    # Frozen parameters (a LoRA run's base weights) are not saved: they come from the base checkpoint.
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    dcp.save({"model": model_sd, "optim": optim_sd, **extra}, storage_writer=writer)  # fsyncs every file it writes
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng = io.BytesIO()
    torch.save(_rng_state(), rng)
    records = dict(writer.records)
    records[f"rng-rank{rank}.pt"] = write_durably(tmp / f"rng-rank{rank}.pt", rng.getvalue())
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict[str, Any] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        records = {name: rec for part in gathered for name, rec in (part or {}).items()}
    if is_main_process():
        state = json.dumps({"step": step, **trainer_state}, indent=2).encode()
        records[TRAINER_STATE] = write_durably(tmp / TRAINER_STATE, state)
        write_manifest(tmp, step, records)
        fsync_dir(tmp)


def _prune(found: list[Path], keep: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, never `keep` (the one just written and so
    the newest verified one). Each goes by a rename first: a prune killed half way leaves a
    `.deleting` folder, never a damaged `step-N` that looks complete."""
    for old in found[:-keep_last]:
        if old != keep:
            doomed = old.with_name(old.name + ".deleting")
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Collective. Restores model + optimizer, and the `extra` namespaces `save_checkpoint` saved, in
    place (any world size); returns trainer_state."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_TRAINABLE)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, **(extra or {})}
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
    return read_trainer_state(path)


def full_state_dict(model: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Collective: gather the full (unsharded) model state dict on CPU; meaningful on rank 0.
    `trainable_only`: leave out frozen parameters (a LoRA run gathers only its adapters)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    # with full_state_dict=True every value is a plain tensor (no DTensor, no nested dicts)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


# Which of a checkpoint's weights `read_checkpoint_model` reads: "model" (the trained ones), or another
# namespace holding the same keys ("ema", `spindle.train.ema`). A context variable, so that every task's
# `export_checkpoint` exports the EMA with no code of its own (`reading_weights`).
_READ_WEIGHTS: ContextVar[str] = ContextVar("spindle_read_weights", default="model")


@contextmanager
def reading_weights(namespace: str) -> Iterator[None]:
    """`read_checkpoint_model` reads the checkpoint's `namespace` weights inside the block."""
    token = _READ_WEIGHTS.set(namespace)
    try:
        yield
    finally:
        _READ_WEIGHTS.reset(token)


def saved_namespaces(path: Path) -> set[str]:
    """The top-level namespaces a DCP checkpoint holds ("model", "optim", "ema", ...)."""
    return {key.split(".", 1)[0] for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}


def saved_model_tensors(path: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """{fqn: (full shape, dtype)} of every model tensor a checkpoint holds (of the `reading_weights`
    namespace), from its metadata alone (nothing is read; the sizes are the whole tensors', whatever world
    size saved them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    namespace = _READ_WEIGHTS.get()  # "model", or "ema" inside `reading_weights("ema")`
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        key.removeprefix(f"{namespace}."): (m.size, m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(f"{namespace}.") and isinstance(m, TensorStorageMetadata)
    }


def read_model_tensors(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read only the model tensors `names` of a checkpoint, whole, on one process (DCP reads each
    tensor's byte ranges from every rank's file; the rest of the checkpoint is not touched)."""
    saved = saved_model_tensors(path)
    if missing := [n for n in names if n not in saved]:
        raise CheckpointError(f"{path} holds no model tensor {missing[0]!r} ({len(missing)} missing)")
    tensors = {n: torch.empty(saved[n][0], dtype=saved[n][1]) for n in names}
    dcp.load({_READ_WEIGHTS.get(): tensors}, checkpoint_id=str(path))
    return tensors


def read_checkpoint_model(path: Path, template: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Read a checkpoint's model weights (the `reading_weights` namespace: "model" unless told) into a plain
    state dict shaped like `template` (1 process)."""
    namespace = _READ_WEIGHTS.get()
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    if not any(key.startswith(f"{namespace}.") for key in saved):
        raise CheckpointError(f"checkpoint {path} holds no {namespace!r} weights")
    # a LoRA checkpoint holds only the adapters: the template's other tensors stay the base weights
    sd = {k: v.detach().clone() for k, v in template.state_dict().items()}
    dcp.load({namespace: {k: v for k, v in sd.items() if f"{namespace}.{k}" in saved}}, checkpoint_id=str(path))
    return sd


def resolve_checkpoint_arg(path: str | Path) -> Path:
    """Accept a checkpoint folder, or a run's output dir (-> its latest checkpoint)."""
    path = Path(path)
    _refuse_partial(path)
    if (path / MANIFEST).is_file() or (path / TRAINER_STATE).is_file():
        if problems := verify_checkpoint(path):
            raise CheckpointError(f"{path} is damaged: {'; '.join(problems)}; use an earlier checkpoint")
        return path
    found = list_checkpoints(path)
    if found:
        return resolve_checkpoint_arg(found[-1])
    raise FileNotFoundError(
        f"{path} is neither a Spindle checkpoint (no {TRAINER_STATE}) nor a run folder with checkpoints/step-N"
    )
