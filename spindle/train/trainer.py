"""The generic training loop: config -> mesh -> condition model + transformer -> steps -> checkpoints.

Nothing here knows a model family: the family's condition model builds inputs, `FlowMatchingTask`
computes the loss, `spindle.distributed` shards and checkpoints.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from spindle.config import ConfigError, TrainJobConfig, dump_config
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.launch import launcher_world_size
from spindle.distributed.mesh import Mesh, ParallelDims, build_mesh, device_type, is_main_process
from spindle.models.base import TimestepSampling, load_transformer
from spindle.registry import get_family, resolve_family
from spindle.train.dit import FlowMatchingTask
from spindle.train.metrics import MetricsLog
from spindle.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("spindle.train")

# diffusers' Wan/Flux forward returns a reshaped view; FSDP2 warns in case the caller edits it in place.
# The task only reads the prediction (out-of-place loss), so the warning is noise on every run.
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


def check_parallel_plan(cfg: TrainJobConfig, world_size: int) -> ParallelDims:
    """Validate the parallel layout against the world size and the model, before any heavy work."""
    import json

    from spindle.distributed.context_parallel import check_sequence_parallel

    dims = ParallelDims(**cfg.parallel.model_dump()).resolve(world_size)
    grad_accum_steps(cfg, dims.dp_size)
    tcfg = Path(cfg.model.path) / "transformer" / "config.json"
    if dims.sp > 1 and tcfg.is_file():
        check_sequence_parallel(json.loads(tcfg.read_text()), dims.sp)
    return dims


class Trainer:
    def __init__(self, cfg: TrainJobConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.train.output_dir)
        check_parallel_plan(cfg, dist.get_world_size() if dist.is_initialized() else launcher_world_size() or 1)
        self.mesh: Mesh = build_mesh(ParallelDims(**cfg.parallel.model_dump()))
        self.device = local_device()
        self.accum = grad_accum_steps(cfg, self.mesh.dims.dp_size)
        self.family = get_family(cfg.model.family) if cfg.model.family else resolve_family(cfg.model.path)
        self.precision = resolve_precision(cfg.train.mixed_precision)
        torch.manual_seed(cfg.train.seed)
        self.condition = self._build_condition()
        self.transformer = self._build_transformer()
        self.optimizer = build_optimizer(self.transformer.parameters(), cfg.train)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.loader = self._build_loader()
        from spindle.distributed.fsdp import autocast_dtype

        self.task = FlowMatchingTask(
            self.condition,
            self.transformer,
            cfg.train.seed,
            cfg.train.loss_weighting,
            autocast_dtype=autocast_dtype(self.transformer, self.precision),
        )
        self.step = 0

    # ------------------------------------------------------------ set-up

    def _build_condition(self):
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        cond = self.family.condition_model_cls().from_pretrained(
            self.cfg.model.path, device=self.device, dtype=dtype, max_text_length=self.cfg.model.max_text_length
        )
        ts = self.cfg.train.timestep
        cond.timestep_sampling = TimestepSampling(
            scheme=ts.scheme,
            logit_mean=ts.logit_mean,
            logit_std=ts.logit_std,
            mode_scale=ts.mode_scale,
            shift=ts.shift,
            num_train_timesteps=cond.timestep_sampling.num_train_timesteps,
        )
        return cond

    def _build_transformer(self) -> torch.nn.Module:
        from spindle.distributed.fsdp import parallelize_transformer

        model = load_transformer(self.cfg.model.path, dtype=torch.float32).to(self.device)
        model.train()
        return parallelize_transformer(
            model,
            self.mesh,
            mixed_precision=self.precision,
            gradient_checkpointing=self.cfg.train.gradient_checkpointing,
        )

    def _build_loader(self):
        from spindle.data.datasets import build_dataset
        from spindle.data.loader import ResumableLoader

        data = self.cfg.data
        dataset = build_dataset(data.path, tuple(data.resolution), data.num_frames, data.skip_bad_samples)
        return ResumableLoader(
            dataset,
            self.cfg.train.micro_batch_size,
            dp_rank=self.mesh.dp_rank,
            dp_size=self.mesh.dims.dp_size,
            seed=self.cfg.train.seed,
            shuffle=data.shuffle,
        )

    # ------------------------------------------------------------ state

    def trainer_state(self) -> dict:
        loader = self.loader.state_dict()
        samples = loader["position"] * self.cfg.train.micro_batch_size * self.mesh.dims.dp_size
        return {
            "model_path": str(Path(self.cfg.model.path).resolve()),
            "family": self.family.name,
            "lr_scheduler": self.scheduler.state_dict(),
            "data": {"epoch": loader["epoch"], "samples_in_epoch": samples},
            "parallel": self.mesh.dims.__dict__,
        }

    def restore(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path, self.transformer, self.optimizer)
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
            self.transformer,
            self.optimizer,
            self.trainer_state(),
            keep_last=self.cfg.checkpoint.keep_last,
        )

    # ------------------------------------------------------------ loop

    def train_step(self) -> tuple[float, float, int, int]:
        """One optimizer step over `accum` micro-batches; returns (loss, grad_norm, samples, tokens) of the step."""
        from spindle.distributed.fsdp import clip_grad_norm_

        total_loss = torch.zeros((), device=self.device)
        samples = tokens = 0
        for _ in range(self.accum):
            batch = next(self.loader)
            out = self.task.forward(batch, self.step, self.device)
            (out.loss / self.accum).backward()
            total_loss += out.loss.detach() / self.accum
            samples, tokens = samples + out.samples, tokens + out.tokens
        grad_norm = clip_grad_norm_(self.transformer.parameters(), self.cfg.train.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (
            _mean_over(self.mesh, total_loss),
            grad_norm,
            samples * self.mesh.dims.dp_size,
            tokens * self.mesh.dims.dp_size,
        )

    def run(self) -> TrainResult:
        cfg = self.cfg
        if is_main_process():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.output_dir / "config.yaml")
        resume = ckpt.resolve_resume(cfg.checkpoint.resume, self.output_dir)
        if resume is not None:
            self.restore(resume)
        metrics = MetricsLog(self.output_dir, self.step, cfg.train.max_steps, enabled=is_main_process())
        try:
            while self.step < cfg.train.max_steps:
                metrics.start_step()
                lr = self.scheduler.get_last_lr()[0]
                loss, grad_norm, samples, tokens = self.train_step()
                self.step += 1
                metrics.end_step(self.step, loss, grad_norm, lr, samples, tokens)
                every = cfg.checkpoint.every_steps
                if every and self.step % every == 0 and self.step < cfg.train.max_steps:
                    self.save()
        finally:
            metrics.close()
        last = self.save()
        export_dir = self.export(last) if cfg.checkpoint.export else None
        return TrainResult(self.output_dir, self.step, export_dir)

    def export(self, checkpoint_dir: Path) -> Path | None:
        sd = ckpt.full_state_dict(self.transformer)
        out = None
        if is_main_process():
            out = ckpt.export_pipeline(self.cfg.model.path, sd, self.output_dir / "export")
        from spindle.distributed.mesh import barrier

        barrier()
        return out


def _mean_over(mesh: Mesh, value: torch.Tensor) -> float:
    """Average a per-rank scalar over data-parallel ranks (SP ranks hold identical values)."""
    if dist.is_initialized() and mesh.dims.dp_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.dp.get_group())  # gloo has no AVG
        value /= mesh.dims.dp_size
    return float(value)


def _truncate_metrics(path: Path, last_step: int) -> None:
    """On resume, drop metric lines of steps that will be re-run (written after the checkpoint)."""
    import json

    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def train(cfg: TrainJobConfig) -> TrainResult:
    return Trainer(cfg).run()
