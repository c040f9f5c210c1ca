"""Training tasks: one per model kind (the contract is `spindle.contracts.task.TrainTask`). A family
record names its task; the entry point looks the task up here, lazily, so importing the trainer imports
no model library. The task class names its own job schema (`config_class`): this is the one registry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spindle.contracts.task import TrainTask

# task name -> "module:Class". A family's `task` field names one of these. A MoE family trains with its
# kind's task (causal_lm, vlm, omni) holding an experts part (spindle.train.parts.experts), chosen from its record.
TASKS: dict[str, str] = {
    "flow_matching": "spindle.train.tasks.flow_matching:FlowMatchingTask",
    "causal_lm": "spindle.train.tasks.causal_lm:CausalLMTask",
    "vlm": "spindle.train.tasks.vlm:VLMTask",
    "omni": "spindle.train.tasks.omni:OmniTask",
}


def get_task(name: str) -> type[TrainTask[Any, Any]]:
    from spindle.contracts.family import import_object

    if name not in TASKS:
        raise ValueError(f"unknown training task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    task: type[TrainTask[Any, Any]] = import_object(TASKS[name])
    return task
