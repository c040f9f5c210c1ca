"""What defines a run (`run.json` in its output folder), so a resume cannot mix two runs up.

A run folder's checkpoints are only meaningful with the settings that produced them: the model, the
data, the optimisation schedule and the seed. `run.json` records those keys (dotted, with paths
resolved) when the run starts; resuming with any of them changed is refused before any work, naming
each changed key with its old and new values, unless the user says so (`checkpoint.resume=force`, or
a new `train.output_dir`). Keys that only change how the same run is computed (the parallel layout,
micro-batch size, activation checkpointing, compile, precision, logging, validation, export) may
change on resume.

Whatever `checkpoint.resume` says, a folder holds one run: `none` (start over) into a folder that holds
checkpoints is refused too (`check_fresh_start`), naming the keys that differ from the recorded run.

`train.max_steps` is not part of the identity: it says where the run stops. The learning-rate
schedule keeps the length recorded when the run started (`schedule_steps`), so extending a run
continues the original schedule (no jump in the learning rate); `force` adopts the new config's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spindle.config import ConfigError, TrainJobConfig

RUN_FILE = "run.json"

# train.* keys that define the run (the rest of `train` is how it is computed, or where it stops)
TRAIN_IDENTITY = (
    "seed",
    "lr",
    "weight_decay",
    "betas",
    "adam_eps",
    "warmup_steps",
    "lr_schedule",
    "min_lr_ratio",
    "grad_clip",
    "global_batch_size",
    "loss_weighting",
    "timestep",
    "lora",
)
# data keys holding paths: recorded resolved, so `data/x` and `./data/x` are the same data
PATH_KEYS = {"path", "precomputed"}
UNSET = "(unset)"


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            _flatten(f"{prefix}.{key}", sub, out)
    else:
        out[prefix] = value


def _resolved(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def run_identity(cfg: TrainJobConfig, family: Any = None) -> dict[str, Any]:
    """The dotted keys (JSON values) that define the run `cfg` describes (of a model of `family`, whose record
    may decide a default: data.packing)."""
    dumped = cfg.model_dump(mode="json")
    model = dumped["model"]
    data = {k: (_resolved(v) if k in PATH_KEYS else v) for k, v in dumped["data"].items()}
    if "packing" in data and data["packing"] is None:
        # the default, recorded as the model resolves it: a run recorded before the default existed matches
        from spindle.train.packing import packs

        data["packing"] = packs(None, cfg.model.path, family)
    out: dict[str, Any] = {}
    _flatten("model", {**model, "path": _resolved(model["path"])}, out)
    _flatten("data", data, out)
    _flatten("train", {k: dumped["train"][k] for k in TRAIN_IDENTITY}, out)
    if dumped["train"].get("ema") is not None:  # the EMA defines the run once on (runs from before it match)
        _flatten("train.ema", dumped["train"]["ema"], out)
    return out


def read_run_record(output_dir: str | Path) -> dict[str, Any] | None:
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{path} is unreadable ({e}); it records the settings of the run in this folder. Restore it, use a new "
            "train.output_dir, or set checkpoint.resume=force to resume with the current settings"
        ) from None
    return record if isinstance(record, dict) else None


def write_run_record(output_dir: str | Path, cfg: TrainJobConfig, schedule_steps: int, family: Any = None) -> None:
    """Rank 0: record what defines the run (at its start, and again when a forced resume adopts new settings)."""
    record = {"identity": run_identity(cfg, family), "schedule_steps": schedule_steps}
    path = Path(output_dir) / RUN_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, old, new) for every key whose value differs (a key on one side only: the other is UNSET)."""
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k, UNSET), new.get(k, UNSET)) for k in keys if old.get(k, UNSET) != new.get(k, UNSET)]


def check_same_run(record: dict[str, Any] | None, cfg: TrainJobConfig, where: Path, family: Any = None) -> None:
    """Refuse to resume the run recorded in `where` with `cfg` when a key that defines it changed."""
    if record is None or "identity" not in record:
        return  # a folder from before run.json: nothing to compare against
    changes = changed_keys(record["identity"], run_identity(cfg, family))
    if not changes:
        return
    listed = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)
    raise ConfigError(
        f"{where} holds a run with other settings, and resuming it would mix two runs up: {listed}. "
        "Use a new train.output_dir, or set checkpoint.resume=force to resume it with the new settings anyway"
    )


def schedule_steps(record: dict[str, Any] | None, cfg: TrainJobConfig, force: bool) -> int:
    """The length the learning-rate schedule is computed for: the run's original one when resuming."""
    if record is None or force or not isinstance(record.get("schedule_steps"), int):
        return cfg.train.max_steps
    return int(record["schedule_steps"])


def check_fresh_start(cfg: TrainJobConfig, checkpoints: list[Path], family: Any = None) -> None:
    """`checkpoint.resume=none` starts over: refused in a folder that holds a run's checkpoints, since
    starting over there would mix two runs' metrics.jsonl, checkpoints and export/ (one run per folder,
    whatever checkpoint.resume says). Names the keys that differ from the recorded run, if any."""
    if cfg.checkpoint.resume != "none" or not checkpoints:
        return
    output_dir = Path(cfg.train.output_dir)
    record = read_run_record(output_dir)
    changes = changed_keys(record["identity"], run_identity(cfg, family)) if record and "identity" in record else []
    differs = (
        "; its settings differ: " + "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes) if changes else ""
    )
    raise ConfigError(
        f"{output_dir} holds the checkpoints of a run (newest {checkpoints[-1].name}){differs}. "
        "checkpoint.resume=none would start over in it and mix two runs' metrics.jsonl, checkpoints and export/. "
        "Use a fresh train.output_dir, checkpoint.resume=auto to continue that run, or checkpoint.resume=force "
        "to resume its newest checkpoint with these settings"
    )


def check_before_launch(cfg: TrainJobConfig, checkpoints: list[Path], family: Any = None) -> None:
    """The one-run-per-folder checks in the process that launches the workers (one line for the user,
    exit 2, instead of one error per rank). The trainer checks again, exactly."""
    check_fresh_start(cfg, checkpoints, family)
    if cfg.checkpoint.resume == "auto" and checkpoints:
        output_dir = Path(cfg.train.output_dir)
        check_same_run(read_run_record(output_dir), cfg, output_dir, family)
