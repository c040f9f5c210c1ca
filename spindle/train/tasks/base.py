"""What the training tasks share beyond the contract (`spindle.contracts.task.TrainTask`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.task import TrainTask
from spindle.data.loader import ResumableLoader
from spindle.data.order import BucketedOrder

if TYPE_CHECKING:
    from spindle.distributed.mesh import Mesh
    from spindle.distributed.sharded_load import TensorSource


def resumable_loader(
    task: TrainTask[Any, Any], dataset: Any, collate_fn: Callable[[list[Any]], Any], order: BucketedOrder | None = None
) -> ResumableLoader:
    """`dataset` as this rank's share of the job's batches: micro/global batch size, seed and
    shuffling from the task's config, the data-parallel rank and size from its mesh; `order`: a
    bucketed / mixed-source epoch order (`spindle.data.order`)."""
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
        order=order,
    )


def build_parallel_model(
    task: TrainTask[Any, Any],
    plan: ParallelPlan,
    build_empty: Callable[[], torch.nn.Module],
    checkpoint: Callable[[], dict[str, TensorSource]],
    load_full: Callable[[], torch.nn.Module],
    convert: Callable[[torch.nn.Module], Any] | None = None,
    fresh: Callable[[str], bool] | None = None,
    init_fresh: Callable[[torch.nn.Module], None] | None = None,
    weights: Path | None = None,
) -> torch.nn.Module:
    """The trainable model of a task, loaded and parallelized on `task.mesh`, in train mode.

    `build_empty()` builds the model's skeleton with its parameters on meta (`empty_weights()`);
    `checkpoint()` -> the checkpoint's tensors as the model holds them (`SafetensorsCheckpoint.sources`,
    after the family adapter's layout conversion); `load_full()` loads the whole model the library's
    way (`model.sharded_load: false`, today's path before sharded loading); `convert` changes the
    model before parallelizing (LoRA adapters); the parameters it adds are not in the checkpoint
    (`fresh(name)` says which) and `init_fresh` gives them their initial values after loading, the
    same in both paths (spindle.train.lora.init_adapters). Then the parameters `convert` froze are
    stored as `train.frozen_dtype` says (spindle.train.precision.frozen_storage; `weights`: the
    safetensors folder the model is read from, whose dtypes `auto` may keep).

    Sharded (default): skeleton -> convert -> parallelize on meta -> each rank reads its shards
    (spindle.distributed.sharded_load). Full: the whole model on every rank -> convert -> parallelize.
    Both refuse a checkpoint whose tensors do not match the model, naming the key, before reading
    any weight.
    """
    from spindle.distributed.fsdp import autocast_dtype
    from spindle.distributed.parallelize import parallelize
    from spindle.distributed.sharded_load import check_checkpoint_keys, checkpoint_key, load_sharded
    from spindle.export.dtypes import stored_float_dtypes
    from spindle.train.precision import frozen_storage, store_frozen

    cfg = task.cfg
    where = str(cfg.model.path)
    sources = checkpoint()
    model = build_empty()
    if not cfg.model.sharded_load:
        # strict on this path too, before reading weights; parameters the model is built with that are not in the
        # checkpoint (a reward model's new score head: `fresh`) get their values from `init_fresh` below
        new = frozenset(checkpoint_key(n) for n, _ in model.named_parameters() if fresh is not None and fresh(n))
        check_checkpoint_keys(model, sources, where, new)
        model = load_full().to(task.device)
    if convert is not None:
        convert(model)
    upcast_at_gather = task.mesh.world.size() > 1 or cfg.train.cpu_offload  # FSDP2 applies (parallelize)
    stored = stored_float_dtypes(weights) if weights is not None and upcast_at_gather else {}
    store_frozen(
        model, frozen_storage(cfg.train.frozen_dtype, task.precision, upcast_at_gather=upcast_at_gather, stored=stored)
    )
    model.train()
    parallelize(
        model,
        cast("Mesh", task.mesh),  # the trainer's Mesh (a MeshLike in the contract)
        plan,
        mixed_precision=task.precision,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        compile=cfg.train.compile,
        cpu_offload=cfg.train.cpu_offload,
    )
    if cfg.model.sharded_load:
        load_sharded(model, sources, task.device, where, fresh)
    if init_fresh is not None:
        init_fresh(model)
    task.autocast_dtype = autocast_dtype(model, task.precision)
    return model
