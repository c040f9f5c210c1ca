"""What the contracts need of Spindle's runtime objects, as `typing.Protocol`s: the contracts import nothing of
Spindle outside themselves (tests/project/test_structure.py), so they name the parts of the mesh, the parallel
layout, a job config, a loader they use by shape, and mypy checks that the real classes have them
(`spindle.distributed.mesh.Mesh`, `ParallelDims`, the `spindle.config` job schemas, `spindle.data.loader.
ResumableLoader`). Read-only members are properties, so a frozen dataclass or a pydantic model satisfies them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # (annotations only: importing the contracts starts no distributed machinery)
    from torch.distributed.device_mesh import DeviceMesh


class ParallelDimsLike(Protocol):
    """A resolved parallel layout (`spindle.distributed.mesh.ParallelDims`): the degree of each mesh dim."""

    @property
    def dp_replicate(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def sp(self) -> int: ...
    @property
    def ring(self) -> int: ...
    @property
    def ep(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def cp_size(self) -> int: ...
    @property
    def fsdp_size(self) -> int: ...


class MeshLike(Protocol):
    """The process mesh a task trains on (`spindle.distributed.mesh.Mesh`): its layout, the named sub-meshes
    (data split, parameter sharding, sequence parallel, expert parallel) and this rank's place in them."""

    @property
    def dims(self) -> ParallelDimsLike: ...
    @property
    def world(self) -> DeviceMesh: ...
    @property
    def dp(self) -> DeviceMesh: ...
    @property
    def fsdp(self) -> DeviceMesh: ...
    @property
    def sp(self) -> DeviceMesh: ...
    @property
    def cp(self) -> DeviceMesh: ...
    @property
    def shard(self) -> DeviceMesh: ...
    @property
    def ep(self) -> DeviceMesh | None: ...
    @property
    def dp_rank(self) -> int: ...
    @property
    def sp_rank(self) -> int: ...


class ModelSectionLike(Protocol):
    """`model:` of a job config (spindle.config.ModelConfig): what every task loads, and how."""

    @property
    def path(self) -> str: ...
    @property
    def sharded_load(self) -> bool: ...


class DataSectionLike(Protocol):
    """`data:` of a job config: each task's own schema; the loader every task builds reads `shuffle`."""

    @property
    def shuffle(self) -> bool: ...


class TrainSectionLike(Protocol):
    """`train:` of a job config (spindle.config.TrainConfig): what the shared loader and model build read."""

    @property
    def output_dir(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def gradient_checkpointing(self) -> bool: ...
    @property
    def cpu_offload(self) -> bool: ...


class JobConfigLike(Protocol):
    """A training job's config (a `spindle.config.TrainJobConfig` subclass, a task's `config_class`): the
    sections every task reads; a task's own class names its concrete schema (`TrainTask[DiTJobConfig, ...]`)."""

    @property
    def model(self) -> ModelSectionLike: ...
    @property
    def data(self) -> DataSectionLike: ...
    @property
    def train(self) -> TrainSectionLike: ...


class TimestepSamplingLike(Protocol):
    """How flow-matching training draws sigmas (the job's `train.timestep`, spindle.config.TimestepConfig): the
    members spindle.ops.flow_matching.TimestepSampling reads (ops imports nothing above it, the contracts nothing
    outside themselves: the two protocols name the same shape)."""

    @property
    def scheme(self) -> str: ...
    @property
    def logit_mean(self) -> float: ...
    @property
    def logit_std(self) -> float: ...
    @property
    def mode_scale(self) -> float: ...
    @property
    def shift(self) -> float: ...


class BatchLoader(Protocol):
    """A resumable iterator of this rank's micro-batches (`spindle.data.loader.ResumableLoader`): the trainer
    saves its position in each checkpoint and restores it on resume. A batch is the task's own (a dict of
    tensors and lists), which only the task and its objective read."""

    def __iter__(self) -> Iterator[Any]: ...
    def __next__(self) -> Any: ...
    def state_dict(self) -> dict[str, int]: ...
    def load_state_dict(self, state: dict[str, int]) -> None: ...


class ActivationEstimate(Protocol):
    """An estimate of one micro-batch's saved activations on a rank (spindle.train.memory.ActivationMemory): a
    dataclass, whose fields the run summary lists."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def total_gb(self) -> float: ...
    def describe(self) -> str: ...
