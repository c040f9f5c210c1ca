"""The generic training loop: config -> mesh -> task (model, data, loss) -> steps -> checkpoints -> export.

Nothing here knows a model kind or family: the task (`spindle.train.tasks`) builds the model and its
data, computes the loss and exports; `spindle.distributed` shards and checkpoints. This module
imports neither diffusers nor transformers (tested).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spindle.config import ConfigError, TrainJobConfig, dump_config
from spindle.contracts.task import TrainTask
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.launch import launcher_world_size
from spindle.distributed.mesh import Mesh, ParallelDims, build_mesh, device_type, is_main_process
from spindle.train.memory import PeakMemory, report_peak_memory
from spindle.train.metrics import MetricsLog
from spindle.train.optim import build_optimizer, build_scheduler
from spindle.train.precision import frozen_dtype

log = logging.getLogger("spindle.train")

# diffusers' Wan/Flux forward returns a reshaped view; FSDP2 warns in case the caller edits it in place.
# Tasks only read the prediction (out-of-place loss), so the warning is noise on every run.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


@dataclass
class TrainResult:
    output_dir: Path
    last_step: int
    export_dir: Path | None


def resolve_precision(mixed_precision: str) -> str:
    if mixed_precision == "auto":
        return "bf16" if torch.cuda.is_available() else "no"
    return mixed_precision


def local_device() -> torch.device:
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def grad_accum_steps(cfg: TrainJobConfig, dp_size: int) -> int:
    per_step = cfg.train.micro_batch_size * dp_size
    if cfg.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({cfg.train.global_batch_size}) must be a multiple of "
            f"train.micro_batch_size x data-parallel size ({cfg.train.micro_batch_size} x {dp_size} = {per_step})"
        )
    return cfg.train.global_batch_size // per_step


def check_parallel_plan(cfg: TrainJobConfig, family: Any, task: type[TrainTask], world_size: int) -> ParallelDims:
    """Validate the parallel layout against the world size and the model, before any heavy work."""
    dims = ParallelDims(**cfg.parallel.model_dump()).resolve(world_size)
    grad_accum_steps(cfg, dims.dp_size)
    if dims.ep > 1 and not task.supports_expert_parallel:
        raise ConfigError(
            f"parallel.ep={dims.ep}: expert parallelism needs a mixture-of-experts model ({task.name} task has "
            "no experts); set parallel.ep: 1"
        )
    task.check_plan(cfg, family, dims)
    return dims


class Trainer:
    """The loop for one job: `cfg` validated against `task.config_class`, `family` the record of the model
    it trains (the entry point resolves both: `spindle.api.make_trainer`)."""

    def __init__(self, cfg: TrainJobConfig, family: Any, task: type[TrainTask]):
        self.cfg = cfg
        self.family = family
        self.output_dir = Path(cfg.train.output_dir)
        world = dist.get_world_size() if dist.is_initialized() else launcher_world_size() or 1
        check_parallel_plan(cfg, family, task, world)
        self.mesh: Mesh = build_mesh(ParallelDims(**cfg.parallel.model_dump()))
        self.device = local_device()
        if cfg.train.keep_freed_memory and self.device.type == "cpu":
            from spindle.cpu_allocator import keep_freed_memory

            keep_freed_memory()  # a step frees and re-allocates the same buffers: no page faults for them
        self.accum = grad_accum_steps(cfg, self.mesh.dims.dp_size)
        self.precision = resolve_precision(cfg.train.mixed_precision)
        frozen_dtype(cfg.train.frozen_dtype, self.precision)  # a bad combination fails before any load
        torch.manual_seed(cfg.train.seed)
        self.task: TrainTask = task(cfg, family, self.mesh, self.device, self.precision)
        self.model = self.task.build_model()
        # peak memory per rank, logged by rank 0: after load here, after the first step in `run`
        self.peak_memory: dict[str, list[PeakMemory]] = {"after load": report_peak_memory("after load", self.device)}
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.loader = self.task.build_loader()
        self.step = 0

    # ------------------------------------------------------------ state

    def trainer_state(self) -> dict[str, Any]:
        loader = self.loader.state_dict()
        samples = loader["position"] * self.cfg.train.micro_batch_size * self.mesh.dims.dp_size
        return {
            "model_path": str(Path(self.cfg.model.path).resolve()),
            "task": self.task.name,
            **self.task.state(),
            "lr_scheduler": self.scheduler.state_dict(),
            "data": {"epoch": loader["epoch"], "samples_in_epoch": samples},
            "parallel": self.mesh.dims.__dict__,
        }

    def restore(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, self.model, self.optimizer)
        self.scheduler.load_state_dict(state["lr_scheduler"])
        per_round = self.cfg.train.micro_batch_size * self.mesh.dims.dp_size
        data = state["data"]
        self.loader.load_state_dict({"epoch": data["epoch"], "position": data["samples_in_epoch"] // per_round})
        self.step = state["step"]
        if is_main_process():
            _truncate_metrics(self.output_dir / "metrics.jsonl", self.step)
            log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        return ckpt.save_checkpoint(
            self.output_dir,
            self.step,
            self.model,
            self.optimizer,
            self.trainer_state(),
            keep_last=self.cfg.checkpoint.keep_last,
        )

    # ------------------------------------------------------------ loop

    def train_step(self) -> tuple[float, float, int, int, dict[str, Any]]:
        """One optimizer step over `accum` micro-batches.

        -> (loss, grad_norm, samples, tokens, extra metrics) of the global batch. The loss is the mean
        over every loss unit (sample, valid token) of the global batch: each micro-batch's summed loss
        is divided by the global unit count (see `spindle.contracts.task`). FSDP2 averages gradients
        over the data-parallel ranks, so each rank scales by dp_size to turn that average into the sum.
        """
        from spindle.distributed.fsdp import clip_grad_norm_tensor_

        batches = [next(self.loader) for _ in range(self.accum)]
        dp_size = self.mesh.dims.dp_size
        units = float(sum(self.task.loss_units(b) for b in batches))  # host counts: no device read
        if dp_size > 1:  # the global count scales the loss before backward (one read with data parallel)
            units = self._sum_over(torch.tensor(units), self.mesh.dp)
        scale = dp_size / max(units, 1.0)
        total_loss = torch.zeros((), device=self.device)
        sums: dict[str, Any] = {}
        samples = tokens = 0
        for batch in batches:
            out = self.task.forward(self.model, batch, self.step)
            (out.loss_sum * scale).backward()
            total_loss += out.loss_sum.detach()
            samples, tokens = samples + out.samples, tokens + out.tokens
            for key, value in out.metrics.items():  # kept on the device until logged
                sums[key] = sums.get(key, 0.0) + (value.detach() if torch.is_tensor(value) else value)
        # No host reads until the update is queued: the norm stays a tensor, clipping runs on the
        # device; the logged scalars (loss, grad norm, task metrics) are read once each, at the end.
        grad_norm = clip_grad_norm_tensor_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_group = self._loss_group()
        loss = self._sum_over(total_loss, loss_group) / max(units, 1.0)
        extra = {
            k: self._sum_over(torch.as_tensor(v, device=self.device), loss_group) / dp_size for k, v in sums.items()
        }
        extra.update(self.task.step_metrics())
        return loss, float(grad_norm), samples * dp_size, tokens * dp_size, extra

    def _loss_group(self) -> DeviceMesh | None:
        """The ranks whose loss sums add up to the global batch's loss sum (None: this rank alone)."""
        if not dist.is_initialized() or self.mesh.world.size() == 1:
            return None
        if self.task.loss_sharded_over_sp and self.mesh.dims.cp_size > 1:
            return self.mesh.world  # each SP rank holds its own chunk's loss
        return self.mesh.dp if self.mesh.dims.dp_size > 1 else None

    def _sum_over(self, value: torch.Tensor, group: DeviceMesh | None) -> float:
        if group is not None:
            value = value.detach().clone().to(self.device)
            # over a (sub)mesh: all of its dims; gloo has no AVG, so always SUM
            for dim in range(group.ndim):
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group.get_group(dim))
        return float(value)

    def run(self) -> TrainResult:
        cfg = self.cfg
        if is_main_process():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.output_dir / "config.yaml")
        resume = ckpt.resolve_resume(cfg.checkpoint.resume, self.output_dir)
        last: Path | None = None
        if resume is not None:
            self.restore(resume)
            last = resume
        metrics = MetricsLog(
            self.output_dir,
            self.step,
            cfg.train.max_steps,
            enabled=is_main_process(),
            tensorboard=cfg.train.tensorboard,
        )
        try:
            while self.step < cfg.train.max_steps:
                metrics.start_step()
                lr = float(self.scheduler.get_last_lr()[0])  # LambdaLR: plain floats
                loss, grad_norm, samples, tokens, extra = self.train_step()
                self.step += 1
                if len(self.peak_memory) == 1:  # the first step of this process (of a resumed run too)
                    when = f"after step {self.step}"
                    self.peak_memory[when] = report_peak_memory(when, self.device)
                metrics.end_step(self.step, loss, grad_norm, lr, samples, tokens, extra)
                self.maybe_validate(metrics)
                every = cfg.checkpoint.every_steps
                if every and self.step % every == 0 and self.step < cfg.train.max_steps:
                    last = self.save()
        finally:
            metrics.close()
        if last is None or ckpt.checkpoint_step(last) != self.step:
            # Never re-save the checkpoint just resumed from: replacing it is the one moment a crash
            # could lose the last good checkpoint, and it would hold the same state.
            last = self.save()
        export_dir = self.export(last) if cfg.checkpoint.export else None
        return TrainResult(self.output_dir, self.step, export_dir)

    def maybe_validate(self, metrics: MetricsLog) -> None:
        """`train.validation`: render samples every N steps without touching the training trajectory:
        the RNG streams are forked (restored afterwards), the model runs in eval mode under no_grad and
        goes back to train mode, and nothing reaches the optimizer."""
        val = self.cfg.train.validation
        if not val.every_steps or not val.prompts or self.step % val.every_steps:
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            self.model.eval()
            try:
                samples = self.task.validate(self.model, self.step, self.output_dir / "samples" / f"step-{self.step}")
            finally:
                self.model.train()
        for index, frames in enumerate(samples):
            metrics.log_sample(self.step, index, frames)

    def export(self, checkpoint_dir: Path) -> Path | None:
        return self.task.export(self.model, self.output_dir / "export")


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines of steps that will be re-run (written after the checkpoint)."""
    import json

    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def train(cfg: TrainJobConfig, family: Any, task: type[TrainTask]) -> TrainResult:
    return Trainer(cfg, family, task).run()
