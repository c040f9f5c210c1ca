"""The task contract: what the generic trainer (`spindle.train.trainer`) delegates to a model kind.

Like torchtitan's train spec hands its trainer a parallelize function, a loss, a dataloader and a
state-dict adapter, a task owns everything that differs between model kinds (a DiT trained by flow
matching, a causal LM trained on next-token loss): building and parallelising the model, its data,
its loss, and its export. The trainer (`spindle.train.trainer`) owns the mesh, the optimizer and
schedule, accumulation, clipping, metrics and checkpoints, and never imports diffusers or
transformers.

Loss normalisation (the one rule every task follows): `forward` returns the *sum* of its per-unit
losses over the micro-batch on this rank, and `loss_units(batch)` says how many units that sum
covers (samples for a DiT, valid label tokens for an LM), counted on the whole batch the rank was
given (before any sequence split). The trainer adds the units of all micro-batches of the step
over the data-parallel ranks and divides by that global count, so the step's loss is the mean
over every unit of the global batch, however it is split into micro-batches, ranks and SP chunks
(no gradient-accumulation loss bug).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from pydantic import BaseModel

from spindle.contracts.family import FamilyFolder
from spindle.contracts.protocols import ActivationEstimate, BatchLoader, JobConfigLike, MeshLike, ParallelDimsLike

# The trainer's types, named by the shape the contract uses (spindle.contracts.protocols) so that this contract
# imports nothing of Spindle outside the contracts: `mesh` is a `spindle.distributed.mesh.Mesh`, `dims` its
# `ParallelDims`, and `build_loader` returns a `spindle.data.loader.ResumableLoader`. A task class binds its job
# schema and its family record kind: `class FlowMatchingTask(TrainTask[DiTJobConfig, DiTFamily])`, so `self.cfg`
# and `self.family` have the concrete types in the task's code. A batch is the task's own (dicts of tensors and
# lists that only the task and its objective read): `Any` here.
CfgT = TypeVar("CfgT", bound=JobConfigLike)  # the task's job schema (`config_class`)
FamilyT = TypeVar("FamilyT", bound=FamilyFolder)  # the kind of family record the task trains
# a value logged for a step: a float or a 0-dim tensor (read off the device when the step's metrics are)
MetricValue = float | torch.Tensor


@dataclass(frozen=True)
class Metric:
    """A value to log from one micro-batch on one rank, with how the trainer reduces it to the step's value.

    `micro_batches`: "sum" adds the step's micro-batches (a count, or a sum that is normalised later), "mean"
    averages them. `ranks`: "chunks" sums the ranks that hold parts of the same samples (SP ranks, each with its
    chunk's share) and averages over data-parallel ranks; "mean" averages over every rank that computed it
    (every SP rank holding the same whole-sample value, e.g. a MoE router's aux loss)."""

    value: MetricValue  # kept on the device until the step's metrics are read
    micro_batches: Literal["sum", "mean"] = "sum"
    ranks: Literal["chunks", "mean"] = "chunks"


@dataclass
class StepOutput:
    """One micro-batch's forward on one rank."""

    loss_sum: torch.Tensor  # differentiable sum of per-unit losses (see the module docstring)
    samples: int  # samples in the micro-batch (for throughput)
    tokens: int  # model tokens processed (for throughput)
    # extra scalars to log: a plain value is Metric(value) (summed over the step's micro-batches, its SP chunks
    # summed, averaged over data-parallel ranks); a `Metric` says its own reduction
    metrics: Mapping[str, MetricValue | Metric] = field(default_factory=dict)


class Objective(Protocol):
    """What a task's step optimises (`train.objective`): a part the task holds (`spindle.train.objectives`),
    so a new objective is one module that works for every model kind offering what it calls, not a subclass per
    kind. The task keeps the model kind's side (model, parallelism, how a batch runs through the model,
    export); the objective owns its data (the loader it builds through the task), its loss and its metrics."""

    name: str

    def check_plan(self, family: FamilyFolder, dims: ParallelDimsLike) -> None:
        """Before launch (config files only): refuse a model kind or layout the objective cannot run, naming why.
        Default: none (an objective subclasses this protocol to take the defaults)."""
        return None

    def prepare(self, task: TrainTask[Any, Any], model: torch.nn.Module) -> None:
        """Collective, after the task built the trainable model: what the objective holds beside it (a frozen
        reference model). Default: nothing."""
        return None

    def build_loader(self, task: TrainTask[Any, Any]) -> BatchLoader:
        """This rank's resumable micro-batches of the objective's data."""
        ...

    def begin_step(self, task: TrainTask[Any, Any], model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        """Collective, before the step's loss units are counted: the step's micro-batches as the loss reads
        them (an online objective generates and scores its rollouts here). Default: as the loader gave them."""
        return batches

    def updates_per_batch(self) -> int:
        """How many optimizer steps train on one `begin_step`'s micro-batches (an online objective's
        `num_iterations`: the steps after the first reuse its rollouts). Default: 1."""
        return 1

    def step_metrics(self, task: TrainTask[Any, Any]) -> dict[str, float]:
        """Collective, after each optimizer step: values the per-micro-batch `StepOutput.metrics` sums cannot
        express (a max over ranks, metrics of the whole global batch). Default: none."""
        return {}

    def loss_units(self, batch: Any) -> int:
        """How many units the loss of `batch` averages over (see the module docstring)."""
        ...

    def forward(self, task: TrainTask[Any, Any], model: torch.nn.Module, batch: Any, step: int) -> StepOutput:
        """The micro-batch's summed loss (differentiable), counts and metrics."""
        ...


class TrainTask(ABC, Generic[CfgT, FamilyT]):
    """One model kind's training: model, data, loss, export. One instance per trainer."""

    name: ClassVar[str]
    # The job schema this task trains with (a `spindle.config.TrainJobConfig` subclass: its `data:`
    # section is the task's). One registry: `spindle.train.tasks.TASKS` names the task, the task names
    # its schema.
    config_class: ClassVar[type[BaseModel]]
    # True when each rank of a sequence-parallel group computes the loss of its own sequence chunk
    # only (so the logged loss is summed over SP ranks too); False when every SP rank holds the loss
    # of the whole sample (diffusers CP gathers the output before the loss).
    loss_sharded_over_sp: ClassVar[bool] = False
    # `export.weights: both`: where the EMA's export goes beside the trained one, as {path in an export
    # that holds weights: its EMA twin's path in the same folder} ("": the whole export; `spindle.train.ema`).
    ema_beside: ClassVar[dict[str, str]] = {"": "ema"}

    @classmethod
    def ema_paths(cls, trainer_state: dict[str, Any]) -> dict[str, str]:
        """`ema_beside` for a run (its `state()`, as saved in trainer_state.json): a task whose exported
        weights' path depends on the run (a two-expert DiT's trained expert) says so here."""
        return dict(cls.ema_beside)

    def __init__(self, cfg: CfgT, family: FamilyT, mesh: MeshLike, device: torch.device, precision: str):
        self.cfg = cfg
        self.family = family
        self.mesh = mesh
        self.device = device
        self.precision = precision
        # The dtype build_model's parallelisation runs the forward under (torch.autocast); None: none.
        self.autocast_dtype: torch.dtype | None = None

    # ------------------------------------------------------------ before any process starts

    @classmethod
    def supports_expert_parallel(cls, family: FamilyT) -> bool:
        """True when the task can run `parallel.ep > 1` on `family`'s models (expert parallelism; MoE)."""
        return False

    @classmethod
    def check_plan(cls, cfg: CfgT, family: FamilyT, dims: ParallelDimsLike) -> None:
        """Static checks of the parallel layout against the model (cheap: config files only)."""
        return None

    @classmethod
    def check_data(cls, cfg: CfgT, family: FamilyT | None = None) -> None:
        """Check the whole dataset before any model is built (e.g. decode every media file once), in the
        format `family`'s checkpoint takes; raise one error listing every unusable sample. Default: none (the
        data is checked as it is built)."""
        return None

    # ------------------------------------------------------------ set-up

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """Load the trainable model on `self.device`, parallelised on `self.mesh`, in train mode."""

    @abstractmethod
    def build_loader(self) -> BatchLoader:
        """A resumable iterator of this rank's micro-batches (`state_dict` / `load_state_dict`)."""

    def data_stats(self) -> dict[str, object]:
        """After `build_loader`: JSON-able counts of the data for the run summary. `rows`, when given, is
        the number of rows (samples) an epoch has, from which the summary computes the epochs that
        `train.max_steps` implies; the rest (documents, truncated, skipped ...) is shown as it is."""
        return {}

    # ------------------------------------------------------------ step

    def _autocast(self) -> AbstractContextManager[None]:
        """The forward's autocast context: `self.autocast_dtype` on this device, or none."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def begin_step(self, model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        """Collective, before the step's loss units are counted: the step's micro-batches as `loss_units` and
        `forward` read them (an online objective's rollouts). Default: as the loader gave them."""
        return batches

    def updates_per_batch(self) -> int:
        """How many optimizer steps train on one `begin_step`'s micro-batches (the trainer fetches and begins new
        ones every that many steps, and checkpoints and stops only between such cycles). Default: 1."""
        return 1

    @abstractmethod
    def loss_units(self, batch: Any) -> int:
        """How many units the loss of `batch` averages over (samples, valid tokens, ...)."""

    @abstractmethod
    def forward(self, model: torch.nn.Module, batch: Any, step: int) -> StepOutput:
        """The micro-batch's summed loss (differentiable) and counts."""

    def activation_memory(self) -> ActivationEstimate | None:
        """After `build_model`: an estimate of one micro-batch's saved activations on a rank (an object with
        `describe()` and `total_gb`, spindle.train.memory.ActivationMemory) for the start-of-run summary; None: no
        estimate for this model kind."""
        return None

    def step_metrics(self) -> dict[str, float]:
        """Collective, after each optimizer step on every rank: values for the step's metrics.jsonl line
        that the per-micro-batch `StepOutput.metrics` sums cannot express (e.g. MoE expert load over the
        global batch: counts per expert and their max/mean). Default: none."""
        return {}

    def validate(self, model: torch.nn.Module, step: int, out_dir: Path) -> list[npt.NDArray[np.floating[Any]]]:
        """Collective: render `train.validation` samples from the in-training model into `out_dir`
        (rank 0 writes); -> the samples as float arrays in [0, 1] ([H, W, 3] or [F, H, W, 3]) for
        TensorBoard. Called under no_grad, in eval mode, with the RNG state forked. Default: none."""
        return []

    # ------------------------------------------------------------ output

    def state(self) -> dict[str, object]:
        """Extra JSON-able facts saved in every checkpoint's trainer_state.json."""
        return {}

    @abstractmethod
    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        """Collective: write the trained model in the input's standard layout; the folder on rank 0."""

    @classmethod
    @abstractmethod
    def export_checkpoint(
        cls, family: FamilyT, checkpoint: Path, model_path: Path, out: Path, dtype: str = "auto", merge: bool = False
    ) -> Path:
        """One process: export a (possibly sharded) training checkpoint (`spindle export`); `dtype` as
        `export.dtype` (auto: the base checkpoint's own precision); `merge` (a LoRA run's checkpoint, as
        `export.merge_lora`): also write `out/merged/`, the full standard folder with the LoRA fused."""
