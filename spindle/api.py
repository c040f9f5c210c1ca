"""Spindle's Python entry points: what a script (or a CLI command) calls.

Each resolves the family of a checkpoint or a job through the registry and hands the family record to
the engines, which never look a family up themselves (docs/architecture.md):

    gen = load_generator("Wan2.1-T2V-1.3B-Diffusers", dtype="bfloat16")   # -> infer.DiffusionGenerator
    cfg = load_job_config("configs/wan_tiny.yaml", ["train.max_steps=10"])   # validated for its family's task
    result = train(cfg)                                                       # -> train.trainer.TrainResult
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spindle.config import ConfigError, ModelSection, TrainJobConfig, load_raw_config, validate_config
from spindle.hub import resolve_model_path
from spindle.registry import Family, dit_family_of, family_of
from spindle.train.tasks import TASKS, get_task

if TYPE_CHECKING:
    from spindle.contracts.task import TrainTask
    from spindle.engine_config import EngineConfig
    from spindle.infer.generator import DiffusionGenerator
    from spindle.infer.pipeline import InferencePipeline
    from spindle.train.trainer import Trainer, TrainResult


# ---------------------------------------------------------------- training


def job_family(raw_or_cfg: dict[str, Any] | TrainJobConfig) -> Family:
    """The family a job trains: `model.family` when given, else detected from `model.path`."""
    if isinstance(raw_or_cfg, TrainJobConfig):
        model = raw_or_cfg.model
    else:
        section = {"model": raw_or_cfg.get("model")} if "model" in raw_or_cfg else {}
        model = validate_config(section, ModelSection).model
    return family_of(model.path, model.family)


def job_task(family: Family) -> type[TrainTask[Any, Any]]:
    if family.task not in TASKS:
        raise ConfigError(f"family {family.name!r} names training task {family.task!r}; known: {', '.join(TASKS)}")
    return get_task(family.task)


def load_job_config(path: str | Path | dict[str, Any] | None, overrides: Sequence[str] = ()) -> Any:
    """YAML + dotted overrides -> the job config, validated against the schema of the task that the
    checkpoint's family trains with (so `data:` is checked for that kind of model)."""
    raw = load_raw_config(path, overrides)
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str):
        # a Hugging Face repo id (`org/name[@revision]`) -> its snapshot in the local cache, before anything reads it
        model["path"] = resolve_model_path(model["path"], "model.path")
    dpo = raw.get("dpo")
    if isinstance(dpo, dict) and isinstance(dpo.get("reference_model"), str):  # a repo id as model.path is
        dpo["reference_model"] = resolve_model_path(dpo["reference_model"], "dpo.reference_model")
    family = job_family(raw)
    task = job_task(family)
    try:
        return validate_config(raw, task.config_class)
    except ConfigError as e:
        if "unknown key" not in str(e):
            raise
        # the keys a job takes follow the kind of model the checkpoint is: say which it was detected as
        detected = f"model {raw['model'].get('path')} is a {family.name} {family.kind} checkpoint"
        raise ConfigError(f"{detected}, so the config follows the {task.name} task's schema; {e}") from None


def check_job_plan(cfg: TrainJobConfig, world_size: int) -> None:
    """The parallel layout against the world size and the model, before any process is launched."""
    from spindle.train.trainer import check_parallel_plan

    family = job_family(cfg)
    check_parallel_plan(cfg, family, job_task(family), world_size)


def make_trainer(cfg: TrainJobConfig) -> Trainer:
    from spindle.train.trainer import Trainer

    family = job_family(cfg)
    return Trainer(cfg, family, job_task(family))


def train(cfg: TrainJobConfig) -> TrainResult:
    return make_trainer(cfg).run()


# ---------------------------------------------------------------- inference


def load_pipeline(
    root: str | Path, options: EngineConfig | None = None, family: str | None = None
) -> InferencePipeline:
    from spindle.infer.pipeline import InferencePipeline

    root = resolve_model_path(root)
    return InferencePipeline.from_pretrained(root, dit_family_of(root, family), options)


def load_generator(root: str | Path, family: str | None = None, **engine_options: Any) -> DiffusionGenerator:
    """A `DiffusionGenerator` for the diffusers pipeline folder `root` (or a Hugging Face repo id `org/name`
    in the local cache, `spindle.hub`); the family is detected from the folder unless `family` names it.
    Engine options are keywords, the fields of `spindle.engine_config.EngineConfig` (dtype, compile, cache,
    sp, lora, ...); a bad value or an unknown name raises `ConfigError` naming it (and the closest valid
    option) before anything loads. The same as `spindle.DiffusionGenerator.from_pretrained(root, **options)`."""
    from spindle.generator import DiffusionGenerator

    return DiffusionGenerator.from_pretrained(root, family, **engine_options)
