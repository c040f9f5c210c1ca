"""The flow-matching task for DiT families: media batch -> conditions -> noisy inputs -> velocity loss.

The family's frozen condition model (text encoders, VAE, scheduler; never sharded) turns a batch
into the transformer's inputs and target; the loss lives here so the transformer stays a pure
diffusers module whose `save_pretrained` is diffusers' own. Export is a full diffusers pipeline
folder: the base checkpoint's components with the trained transformer.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spindle.distributed import checkpoint as ckpt
from spindle.distributed.mesh import barrier, is_main_process
from spindle.models.base import ConditionModel, TimestepSampling, load_transformer
from spindle.registry import get_family, resolve_family
from spindle.train.metrics import count_tokens
from spindle.train.tasks.base import StepOutput, TrainTask


def sample_generator(seed: int, step: int, sample_index: int) -> torch.Generator:
    """A per-sample RNG keyed on (seed, step, dataset index).

    Keying on the sample, not on the rank or micro-batch, is what makes a data-parallel run (and a
    resumed run) draw exactly the noise and timesteps of the single-process run, and gives every rank
    of a sequence-parallel group the same draws.
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{sample_index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def loss_weights(sigmas: torch.Tensor, scheme: str) -> torch.Tensor | None:
    if scheme == "none":
        return None
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    return compute_loss_weighting_for_sd3(scheme, sigmas=sigmas)


class FlowMatchingTask(TrainTask):
    name = "flow_matching"
    loss_sharded_over_sp = False  # diffusers CP gathers the output: every SP rank holds the whole loss

    def __init__(self, cfg, mesh, device, precision):
        super().__init__(cfg, mesh, device, precision)
        self.family = get_family(cfg.model.family) if cfg.model.family else resolve_family(cfg.model.path)
        self.seed = cfg.train.seed
        self.loss_weighting = cfg.train.loss_weighting
        self.autocast_dtype: torch.dtype | None = None
        self.condition = self._build_condition()

    # ------------------------------------------------------------ checks before launch

    @classmethod
    def check_plan(cls, cfg, dims) -> None:
        from spindle.distributed.context_parallel import check_sequence_parallel

        tcfg = Path(cfg.model.path) / "transformer" / "config.json"
        if dims.cp_size > 1 and tcfg.is_file():
            check_sequence_parallel(json.loads(tcfg.read_text()), dims.sp, ring=dims.ring)

    # ------------------------------------------------------------ set-up

    def _build_condition(self) -> ConditionModel:
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

    def build_model(self) -> torch.nn.Module:
        from spindle.distributed.fsdp import autocast_dtype, parallelize_transformer

        model = load_transformer(self.cfg.model.path, dtype=torch.float32).to(self.device)
        model.train()
        model = parallelize_transformer(
            model,
            self.mesh,
            mixed_precision=self.precision,
            gradient_checkpointing=self.cfg.train.gradient_checkpointing,
            compile=self.cfg.train.compile,
        )
        self.autocast_dtype = autocast_dtype(model, self.precision)
        return model

    def build_loader(self):
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
            global_batch_size=self.cfg.train.global_batch_size,
        )

    # ------------------------------------------------------------ step

    def loss_units(self, batch: dict[str, Any]) -> int:
        return len(batch["index"])  # the loss is a mean over samples

    def _autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def forward(self, model: torch.nn.Module, batch: dict[str, Any], step: int) -> StepOutput:
        conditions = self.condition.encode(batch)
        generators = [sample_generator(self.seed, step, int(i)) for i in batch["index"]]
        inputs = self.condition.training_inputs(conditions, generators)
        target = inputs.pop("target").to(self.device)
        sigmas = inputs.pop("sigmas")
        inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        patch = getattr(getattr(model, "config", None), "patch_size", 1)
        tokens_per_sample = count_tokens(inputs["hidden_states"], patch)
        self._check_sequence_split(model, tokens_per_sample, inputs)
        with self._autocast():
            pred = model(**inputs, return_dict=False)[0]
        per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").flatten(1).mean(1)
        weights = loss_weights(sigmas, self.loss_weighting)
        if weights is not None:
            per_sample = per_sample * weights.to(per_sample)
        return StepOutput(per_sample.sum(), len(generators), tokens_per_sample * len(generators))

    @staticmethod
    def _check_sequence_split(model: torch.nn.Module, tokens: int, inputs: dict[str, Any]) -> None:
        """SP (Ulysses x ring) splits sequences evenly; say so clearly instead of failing inside diffusers."""
        from spindle.distributed.context_parallel import (
            check_sequence_parallel,
            check_split_inputs,
            sequence_parallel_degrees,
        )

        sp, ring = sequence_parallel_degrees(model)
        if sp * ring > 1:
            check_sequence_parallel(model, sp, seq_len=tokens, ring=ring)
            check_split_inputs(model, sp * ring, inputs)

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        return {"family": self.family.name}

    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        sd = ckpt.full_state_dict(model)
        result = export_pipeline(self.cfg.model.path, sd, out) if is_main_process() else None
        barrier()
        return result

    @classmethod
    def export_checkpoint(cls, checkpoint: Path, model_path: Path, out: Path) -> Path:
        if not (model_path / "model_index.json").is_file():
            raise FileNotFoundError(f"base model {model_path} has no model_index.json; pass --model PATH")
        template = load_transformer(model_path)
        return export_pipeline(model_path, ckpt.read_checkpoint_model(checkpoint, template), out)


def export_pipeline(source_root: str | Path, state_dict: dict[str, torch.Tensor], out: str | Path) -> Path:
    """Write a diffusers pipeline folder: every component of `source_root`, with the trained transformer.

    The transformer is rebuilt from its own diffusers config and saved with diffusers' `save_pretrained`,
    so `config.json` carries only diffusers keys and stock diffusers loads the folder with no Spindle code.
    Written to `<out>.tmp` first, then renamed.
    """
    import diffusers

    source_root, out = Path(source_root), Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source_root, tmp, ignore=shutil.ignore_patterns("transformer"))
    config = json.loads((source_root / "transformer" / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    model = cls.from_config(cls.load_config(source_root / "transformer"))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"trained weights do not fit {cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.save_pretrained(tmp / "transformer", safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
