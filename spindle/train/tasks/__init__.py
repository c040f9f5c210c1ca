"""Training tasks: one per model kind (see `base.TrainTask`). A family names its task; the trainer
looks it up here, lazily, so importing the trainer imports no model library."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spindle.config import TrainJobConfig
    from spindle.train.tasks.base import TrainTask

# task name -> "module:Class". A family's `task` field names one of these.
TASKS: dict[str, str] = {
    "flow_matching": "spindle.train.tasks.flow_matching:FlowMatchingTask",
    "causal_lm": "spindle.train.tasks.causal_lm:CausalLMTask",
}


def get_task(name: str) -> type[TrainTask]:
    from spindle.models.base import import_object

    if name not in TASKS:
        raise ValueError(f"unknown training task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return import_object(TASKS[name])


def task_for(cfg: TrainJobConfig) -> type[TrainTask]:
    """The task class of the family that `cfg.model` names or points at."""
    from spindle.registry import family_of

    return get_task(family_of(cfg.model.path, cfg.model.family).task)
