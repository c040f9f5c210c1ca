"""What the training tasks share beyond the contract (`spindle.contracts.task.TrainTask`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spindle.contracts.task import TrainTask
from spindle.data.loader import ResumableLoader


def resumable_loader(task: TrainTask, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> ResumableLoader:
    """`dataset` as this rank's share of the job's batches: micro/global batch size, seed and
    shuffling from the task's config, the data-parallel rank and size from its mesh."""
    cfg = task.cfg
    return ResumableLoader(
        dataset,
        cfg.train.micro_batch_size,
        dp_rank=task.mesh.dp_rank,
        dp_size=task.mesh.dims.dp_size,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
        collate_fn=collate_fn,
        global_batch_size=cfg.train.global_batch_size,
    )
