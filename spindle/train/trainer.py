"""The generic training loop: config -> mesh -> task (model, data, loss) -> steps -> checkpoints -> export.

Nothing here knows a model kind or family: the task (`spindle.train.tasks`) builds the model and its
data, computes the loss and exports; `spindle.distributed` shards and checkpoints. This module
imports neither diffusers nor transformers (tested).
"""

from __future__ import annotations

import logging
import signal
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spindle.config import ConfigError, TrainJobConfig, dump_config
from spindle.contracts.task import Metric, TrainTask
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.launch import launcher_world_size
from spindle.distributed.mesh import Mesh, ParallelDims, build_mesh, device_type, is_main_process
from spindle.export.target import record_export, refuse_protected
from spindle.train.ema import build_ema, ema_checkpoint_state, export_weights, few_updates_warning
from spindle.train.memory import PeakMemory, frozen_parameter_bytes, report_peak_memory, state_memory_per_rank
from spindle.train.metrics import MetricsLog, truncate_metrics
from spindle.train.optim import build_optimizer, build_scheduler
from spindle.train.output_lock import OutputLock, held_by_our_launcher
from spindle.train.precision import frozen_dtype
from spindle.train.run_record import (
    check_fresh_start,
    check_same_run,
    read_run_record,
    schedule_steps,
    write_run_record,
)
from spindle.train.run_summary import (
    EndTracker,
    epochs_for,
    format_end,
    format_start,
    mesh_layout,
    parameter_counts,
    say,
    write_summary,
)
from spindle.train.stop import StopRequest
from spindle.weight_files import check_weight_files

log = logging.getLogger("spindle.train")

# diffusers' Wan/Flux forward returns a reshaped view; FSDP2 warns in case the caller edits it in place.
# Tasks only read the prediction (out-of-place loss), so the warning is noise on every run.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


@dataclass
class TrainResult:
    output_dir: Path
    last_step: int
    export_dir: Path | None
    # True when the run was already at train.max_steps: nothing was trained or written
    already_complete: bool = False
    # the signal (SIGTERM / SIGINT) that stopped the run after `last_step`, its checkpoint saved (spindle.train.stop)
    stopped_by: int | None = None


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


def check_parallel_plan(
    cfg: TrainJobConfig, family: Any, task: type[TrainTask[Any, Any]], world_size: int
) -> ParallelDims:
    """Validate the parallel layout against the world size and the model, before any heavy work."""
    dims = ParallelDims(**cfg.parallel.model_dump()).resolve(world_size)
    grad_accum_steps(cfg, dims.dp_size)
    if dims.ep > 1 and not task.supports_expert_parallel(family):
        raise ConfigError(
            f"parallel.ep={dims.ep}: expert parallelism needs a mixture-of-experts model ({task.name} task has "
            "no experts); set parallel.ep: 1"
        )
    task.check_plan(cfg, family, dims)
    return dims


class Trainer:
    """The loop for one job: `cfg` validated against `task.config_class`, `family` the record of the model
    it trains (the entry point resolves both: `spindle.api.make_trainer`)."""

    def __init__(self, cfg: TrainJobConfig, family: Any, task: type[TrainTask[Any, Any]]):
        self.cfg = cfg
        self.family = family
        self.output_dir = Path(cfg.train.output_dir)
        world = dist.get_world_size() if dist.is_initialized() else launcher_world_size() or 1
        check_parallel_plan(cfg, family, task, world)
        self.mesh: Mesh = build_mesh(ParallelDims(**cfg.parallel.model_dump()))
        # One run per output folder, checked before the model is built (`spindle.train.output_lock`);
        # under `spindle train --nproc N` the launcher holds it for its workers.
        self.lock = OutputLock(self.output_dir)
        if is_main_process() and not held_by_our_launcher(self.output_dir):
            self.lock.acquire()
        try:
            # Which checkpoint to resume from, verified before the model is built: a damaged explicit
            # checkpoint.resume is an error naming the file; `auto` skips damaged ones.
            self.resume_from = ckpt.resolve_resume(cfg.checkpoint.resume, self.output_dir)
            self._check_resume(cfg)
            if cfg.checkpoint.export:  # the end-of-run export replaces <output_dir>/export: never the base model
                refuse_protected(
                    self.output_dir / "export",
                    {"base model (model.path)": cfg.model.path},
                    "train from a copy of it, or choose another train.output_dir",
                )
            # Extra start-of-run summary fields (name -> JSON-able value) other steps measure.
            self.summary_extra: dict[str, Any] = {}
            if not self.already_complete:
                task.check_data(cfg, family)  # the whole dataset, before the model is built
                self._build(cfg, family, task)
        except BaseException:
            self.lock.release()
            raise

    def _check_resume(self, cfg: TrainJobConfig) -> None:
        """A resume continues the same run (`spindle.train.run_record`): the keys that define it are
        unchanged (unless checkpoint.resume=force) and the schedule keeps its original length; a run
        already at max_steps is complete (nothing is built, trained or written)."""
        self.force = cfg.checkpoint.resume == "force"
        check_fresh_start(cfg, ckpt.list_checkpoints(self.output_dir), self.family)
        self.resume_step = ckpt.checkpoint_step(self.resume_from) if self.resume_from is not None else 0
        # the folder of the run the checkpoint belongs to (an explicit checkpoint may be another run's)
        run_dir = self.resume_from.parent.parent if self.resume_from is not None else self.output_dir
        self.run_record = read_run_record(run_dir) if self.resume_from is not None else None
        if self.resume_from is not None and not self.force:
            check_same_run(self.run_record, cfg, run_dir, self.family)
        self.schedule_steps = schedule_steps(self.run_record, cfg, self.force)
        self.already_complete = self.resume_from is not None and self.resume_step >= cfg.train.max_steps

    def _build(self, cfg: TrainJobConfig, family: Any, task: type[TrainTask[Any, Any]]) -> None:
        check_weight_files(cfg.model.path)
        self.device = local_device()
        if self.device.type == "cpu":
            from spindle.cpu_allocator import bound_freed_memory, keep_freed_memory

            # RSS bounds what fits on a host; see spindle.cpu_allocator for the measured trade-off
            keep_freed_memory() if cfg.train.keep_freed_memory else bound_freed_memory()
        self.accum = grad_accum_steps(cfg, self.mesh.dims.dp_size)
        self.precision = resolve_precision(cfg.train.mixed_precision)
        frozen_dtype(cfg.train.frozen_dtype, self.precision)  # a bad combination fails before any load
        torch.manual_seed(cfg.train.seed)
        self.task: TrainTask[Any, Any] = task(cfg, family, self.mesh, self.device, self.precision)
        self.model = self.task.build_model()
        # peak memory per rank, logged by rank 0: after load here, after the first step in `run`
        self.peak_memory: dict[str, list[PeakMemory]] = {"after load": report_peak_memory("after load", self.device)}
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train)
        # the run's original schedule length on resume: extending max_steps does not make the lr jump
        self.scheduler = build_scheduler(
            self.optimizer, cfg.train.model_copy(update={"max_steps": self.schedule_steps})
        )
        self.loader = self.task.build_loader()
        # optimizer steps per begin_step (an online objective's num_iterations): checkpoints and stops fall
        # between such cycles, so a resume never needs the batches of a cycle half trained
        self.updates = self.task.updates_per_batch()
        self._batches: list[Any] | None = None
        self.ema = build_ema(self.model, cfg.train.ema)  # `train.ema`: sharded like the weights (spindle.train.ema)
        if self.ema is not None:
            self.summary_extra["ema"] = self.ema.describe(cfg.export_weights)
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
            # what `spindle export` exports by default, and whether the checkpoint holds an EMA
            "ema": self.cfg.train.ema.model_dump() if self.cfg.train.ema is not None else None,
            "export_weights": self.cfg.export_weights,
        }

    def restore(self, path: Path) -> None:
        extra = ema_checkpoint_state(self.ema, path)
        state = ckpt.load_checkpoint(path, self.model, self.optimizer, extra)
        if self.ema is not None and not extra:  # a forced resume of a run without one: from the loaded weights
            self.ema = build_ema(self.model, self.cfg.train.ema)
        self.scheduler.load_state_dict(state["lr_scheduler"])
        per_round = self.cfg.train.micro_batch_size * self.mesh.dims.dp_size
        data = state["data"]
        self.loader.load_state_dict({"epoch": data["epoch"], "position": data["samples_in_epoch"] // per_round})
        self.step = state["step"]
        if is_main_process():
            say(f"resumed from step {self.step} (checkpoint {path})")

    def save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.output_dir,
            self.step,
            self.model,
            self.optimizer,
            self.trainer_state(),
            keep_last=self.cfg.checkpoint.keep_last,
            extra=ema_checkpoint_state(self.ema),
        )
        if is_main_process():
            log.info("step %d: checkpoint saved to %s", self.step, path)
        return path

    # ------------------------------------------------------------ loop

    def train_step(self) -> tuple[float, float, int, int, dict[str, Any]]:
        """One optimizer step over `accum` micro-batches.

        -> (loss, grad_norm, samples, tokens, extra metrics) of the global batch. The loss is the mean
        over every loss unit (sample, valid token) of the global batch: each micro-batch's summed loss
        is divided by the global unit count (see `spindle.contracts.task`). FSDP2 averages gradients
        over the data-parallel ranks, so each rank scales by dp_size to turn that average into the sum.
        """
        from spindle.distributed.fsdp import clip_grad_norm_tensor_

        if self.step % self.updates == 0 or self._batches is None:  # else: the cycle's batches again
            self._batches = self.task.begin_step(self.model, [next(self.loader) for _ in range(self.accum)], self.step)
        batches = self._batches
        dp_size = self.mesh.dims.dp_size
        units = float(sum(self.task.loss_units(b) for b in batches))  # host counts: no device read
        if dp_size > 1:  # the global count scales the loss before backward (one read with data parallel)
            units = self._sum_over(torch.tensor(units), self.mesh.dp)
        scale = dp_size / max(units, 1.0)
        total_loss = torch.zeros((), device=self.device)
        sums: dict[str, Any] = {}
        reductions: dict[str, Metric] = {}
        samples = tokens = 0
        for batch in batches:
            out = self.task.forward(self.model, batch, self.step)
            (out.loss_sum * scale).backward()
            total_loss += out.loss_sum.detach()
            samples, tokens = samples + out.samples, tokens + out.tokens
            for key, metric in out.metrics.items():  # kept on the device until logged
                metric = reductions[key] = metric if isinstance(metric, Metric) else Metric(metric)
                value = metric.value.detach() if torch.is_tensor(metric.value) else metric.value
                sums[key] = sums.get(key, 0.0) + value
        # No host reads until the update is queued: the norm stays a tensor, clipping runs on the
        # device; the logged scalars (loss, grad norm, task metrics) are read once each, at the end.
        grad_norm = clip_grad_norm_tensor_(self.model.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss_group = self._loss_group()
        loss = self._sum_over(total_loss, loss_group) / max(units, 1.0)
        extra = {k: self._reduce(v, reductions[k], loss_group, len(batches)) for k, v in sums.items()}
        extra.update(self.task.step_metrics())
        return loss, float(grad_norm), samples * dp_size, tokens * dp_size, extra

    def _loss_group(self) -> DeviceMesh | None:
        """The ranks whose loss sums add up to the global batch's loss sum (None: this rank alone)."""
        if not dist.is_initialized() or self.mesh.world.size() == 1:
            return None
        if self.task.loss_sharded_over_sp and self.mesh.dims.cp_size > 1:
            return self.mesh.world  # each SP rank holds its own chunk's loss
        return self.mesh.dp if self.mesh.dims.dp_size > 1 else None

    def _reduce(self, step_sum: Any, metric: Metric, loss_group: DeviceMesh | None, micro_batches: int) -> float:
        """A metric's sum over this rank's `micro_batches` (what `begin_step` made of the loader's: an online
        objective's update batches) -> the step's value, as `metric` declares."""
        total = self._sum_over(torch.as_tensor(step_sum, device=self.device), loss_group)
        if metric.micro_batches == "mean":
            total /= micro_batches
        if metric.ranks == "mean":
            return total / (1 if loss_group is None else loss_group.size())
        return total / self.mesh.dims.dp_size  # SP chunks summed, data-parallel ranks averaged

    def _sum_over(self, value: torch.Tensor, group: DeviceMesh | None) -> float:
        if group is not None:
            value = value.detach().clone().to(self.device)
            # over a (sub)mesh: all of its dims; gloo has no AVG, so always SUM
            for dim in range(group.ndim):
                dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group.get_group(dim))
        return float(value)

    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            self.lock.release()

    def _run(self) -> TrainResult:
        cfg = self.cfg
        if self.already_complete:
            return self._complete()
        if is_main_process():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.output_dir / "config.yaml")
            if self.resume_from is None or self.force or self.run_record is None:
                write_run_record(self.output_dir, cfg, self.schedule_steps, self.family)
        last: Path | None = None
        if self.resume_from is not None:
            self.restore(self.resume_from)
            last = self.resume_from
        self.start_summary()
        tracker = EndTracker(self.step)
        if is_main_process():
            # The record starts where training starts: lines of steps that will run again (after the
            # checkpoint resumed from, or all of them when starting over) would repeat their steps.
            truncate_metrics(self.output_dir, self.step)
        metrics = MetricsLog(
            self.output_dir,
            self.step,
            cfg.train.max_steps,
            enabled=is_main_process(),
            tensorboard=cfg.train.tensorboard,
        )
        stop = StopRequest()
        stopped_by = None
        try:
            stop.__enter__()
            while self.step < cfg.train.max_steps:
                metrics.start_step()
                lr = float(self.scheduler.get_last_lr()[0])  # LambdaLR: plain floats
                loss, grad_norm, samples, tokens, extra = self.train_step()
                self.step += 1
                if self.ema is not None:
                    self.ema.update(self.step)
                tracker.step(loss, samples, tokens)
                if len(self.peak_memory) == 1:  # the first step of this process (of a resumed run too)
                    when = f"after step {self.step}"
                    self.peak_memory[when] = report_peak_memory(when, self.device)
                metrics.end_step(self.step, loss, grad_norm, lr, samples, tokens, extra)
                self.maybe_validate(metrics)
                every = cfg.checkpoint.every_steps
                boundary = self.step % self.updates == 0
                if every and self.step % every == 0 and self.step < cfg.train.max_steps and boundary:
                    last = self.save()
                stopped_by = stop.agreed(self.device)
                if stopped_by is not None and self.step < cfg.train.max_steps and boundary:
                    break
                stopped_by = None
        finally:
            stop.__exit__()
            metrics.close()
        if stopped_by is not None:
            if last is None or ckpt.checkpoint_step(last) != self.step:
                last = self.save()
            if is_main_process():
                say(
                    f"stopped by {signal.Signals(stopped_by).name} after step {self.step}: checkpoint {last} saved; "
                    f"continue with checkpoint.resume=auto (the same train.output_dir)"
                )
            return TrainResult(self.output_dir, self.step, None, stopped_by=stopped_by)
        if last is None or ckpt.checkpoint_step(last) != self.step:
            # Never re-save the checkpoint just resumed from: replacing it is the one moment a crash
            # could lose the last good checkpoint, and it would hold the same state.
            last = self.save()
        export_dir = self.export(last) if cfg.checkpoint.export else None
        if is_main_process():
            end = tracker.finish(self.step)
            write_summary(self.output_dir, end=end)
            say(format_end(end))
        return TrainResult(self.output_dir, self.step, export_dir)

    def _complete(self) -> TrainResult:
        """The run is already at max_steps: say so and touch nothing (config.yaml, records, checkpoints)."""
        export = self.output_dir / "export"
        export_dir = export if export.is_dir() else None
        if is_main_process():
            exported = (
                str(export_dir) if export_dir else f"none (write one with `spindle export {self.output_dir} --out DIR`)"
            )
            say(
                f"run already complete: step {self.resume_step} of train.max_steps={self.cfg.train.max_steps} "
                f"(checkpoint {self.resume_from}); export: {exported}. Raise train.max_steps to train further, "
                "or set a new train.output_dir for a new run"
            )
        return TrainResult(self.output_dir, self.resume_step, export_dir, already_complete=True)

    def start_summary(self) -> dict[str, Any]:
        """Rank 0 prints what the run is about to do, and writes it to summary.json (`run_summary`)."""
        cfg = self.cfg
        trainable, frozen = parameter_counts(self.model)
        data = self.task.data_stats()
        val = cfg.train.validation
        outputs = {"folder": str(self.output_dir), "checkpoints": str(ckpt.checkpoint_root(self.output_dir))}
        if val.every_steps and val.prompts:
            outputs["samples"] = str(self.output_dir / "samples")
        if cfg.checkpoint.export:
            outputs["export"] = str(self.output_dir / "export")
        summary = {
            "family": self.family.name,
            "task": self.task.name,
            "max_steps": cfg.train.max_steps,
            "schedule_steps": self.schedule_steps,
            "global_batch_size": cfg.train.global_batch_size,
            "data": data,
            "epochs": epochs_for(cfg.train.max_steps, cfg.train.global_batch_size, data),
            "parameters": {"trainable": trainable, "frozen": frozen},
            # the same estimate bench/config_memory.py prints for the shipped configs
            "state_memory": asdict(
                state_memory_per_rank(
                    trainable,
                    frozen_parameter_bytes(self.model),
                    self.mesh.dims.fsdp_size,
                    ema=cfg.train.ema is not None,
                )
            ),
            "mesh": mesh_layout(self.mesh.dims),
            **(
                {"activation_memory": asdict(act) | {"total_gb": act.total_gb}}
                if (act := self.task.activation_memory())
                else {}
            ),
            "precision": self.precision,
            "resume": {"step": self.step, "checkpoint": str(self.resume_from) if self.resume_from else None},
            "outputs": outputs,
            "extra": dict(self.summary_extra),
        }
        if is_main_process():
            write_summary(self.output_dir, start=summary)
            say(format_start(summary))
        return summary

    def maybe_validate(self, metrics: MetricsLog) -> None:
        """`train.validation`: render samples every N steps without touching the training trajectory:
        the RNG streams are forked (restored afterwards), the model runs in eval mode under no_grad and
        goes back to train mode, and nothing reaches the optimizer."""
        val = self.cfg.train.validation
        if not val.every_steps or not val.prompts or self.step % val.every_steps:
            return
        devices = [self.device] if self.device.type == "cuda" else []
        ema = self.ema if self.cfg.validate_with_ema else None
        weights = ema.swapped_in(self.model) if ema is not None else nullcontext()
        with torch.random.fork_rng(devices=devices), torch.no_grad(), weights:
            self.model.eval()
            try:
                samples = self.task.validate(
                    self.model, self.step, self.output_dir / "samples" / ckpt.step_dirname(self.step)
                )
            finally:
                self.model.train()
        for index, frames in enumerate(samples):
            metrics.log_sample(self.step, index, frames)
        if samples and is_main_process():
            where = self.output_dir / "samples" / ckpt.step_dirname(self.step)
            log.info("step %d: %d validation sample(s) written to %s", self.step, len(samples), where)

    def export(self, checkpoint_dir: Path) -> Path | None:
        """`export.weights`: the trained weights, their EMA, or both (`spindle.train.ema.export_weights`)."""
        ema = self.ema
        if ema is not None and self.cfg.export_weights != "trained" and is_main_process():
            if (warning := few_updates_warning(ema.config, self.step)) is not None:
                log.warning(warning)
        out = export_weights(
            self.cfg.export_weights,
            self.output_dir / "export",
            lambda out: self.task.export(self.model, out),
            lambda: ema.swapped_in(self.model) if ema is not None else nullcontext(),
            self.task.ema_paths(self.task.state()),
        )
        if out is not None:  # `spindle export --force` may replace it later
            record_export(out, family=self.family.name, base_model=str(Path(self.cfg.model.path).resolve()))
        return out


def train(cfg: TrainJobConfig, family: Any, task: type[TrainTask[Any, Any]]) -> TrainResult:
    return Trainer(cfg, family, task).run()
