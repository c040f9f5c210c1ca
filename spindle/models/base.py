"""The family contract for DiT models, and the flow-matching helpers every family shares.

A family provides (see docs/architecture.md):
- a `ConditionModel`: frozen, never-sharded components (text encoders, VAE, scheduler) with
  `encode(batch)` and `training_inputs(conditions, generator)`;
- the transformer: the diffusers class itself, loaded from `root/transformer`;
- inference pieces: a `BeforeDenoisingStage` subclass, callbacks for the shared stages, defaults.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


def import_object(path: str) -> Any:
    """'package.module:attr' -> attr (keeps family registration free of heavy imports)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DiTFamily:
    name: str
    pipeline_classes: tuple[str, ...]
    transformer_classes: tuple[str, ...]
    condition_model: str  # "module:Class" of a ConditionModel subclass
    inference: str | None = None  # "module:object" of the family's inference spec (infer/)
    tiny_model: str | None = None  # "module:function(out, seed, **overrides)"
    detect: Callable[[Path], bool] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def condition_model_cls(self) -> type["ConditionModel"]:
        return import_object(self.condition_model)

    def inference_spec(self) -> Any:
        if self.inference is None:
            raise NotImplementedError(f"family {self.name!r} has no inference support yet")
        return import_object(self.inference)


def load_transformer(root: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load the diffusers transformer class named in `root/transformer/config.json`."""
    import json

    import diffusers

    tdir = Path(root) / "transformer"
    cfg_path = tdir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: the checkpoint has no transformer component")
    cls_name = json.loads(cfg_path.read_text())["_class_name"]
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ValueError(f"{cfg_path} names {cls_name!r}, which diffusers {diffusers.__version__} does not provide")
    return cls.from_pretrained(tdir, dtype=dtype)


# ---------------------------------------------------------------- flow matching (shared by families)

TIMESTEP_SCHEMES = ("uniform", "logit_normal", "mode")


@dataclass
class TimestepSampling:
    """How training draws sigma in (0, 1). `shift` applies the SD3/Wan shift s*t / (1 + (s-1)*t)."""

    scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 1.0
    num_train_timesteps: int = 1000


def sample_sigmas(cfg: TimestepSampling, generators: list[torch.Generator]) -> torch.Tensor:
    """One sigma per sample, each drawn from that sample's own generator (see `flow_matching_pair`)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    if cfg.scheme not in TIMESTEP_SCHEMES:
        raise ValueError(f"unknown timestep scheme {cfg.scheme!r}; choose one of {TIMESTEP_SCHEMES}")
    u = torch.cat([
        compute_density_for_timestep_sampling(
            weighting_scheme=cfg.scheme, batch_size=1, logit_mean=cfg.logit_mean, logit_std=cfg.logit_std,
            mode_scale=cfg.mode_scale, generator=g,
        )
        for g in generators
    ])
    return shift_sigmas(u.clamp(0.0, 1.0), cfg.shift)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_matching_pair(
    x0: torch.Tensor, sigmas: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified flow: x_t = (1 - s) x0 + s * noise, velocity target = noise - x0.

    Noise comes from one CPU generator per sample, so a sample gets the same noise whichever rank or
    micro-batch it lands on: data-parallel and resumed runs reproduce single-process runs exactly.
    """
    from diffusers.utils.torch_utils import randn_tensor

    noise = randn_tensor(tuple(x0.shape), generator=generators, dtype=torch.float32).to(x0.device, x0.dtype)
    s = sigmas.to(x0.device, x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0 + s * noise, noise - x0


class ConditionModel(ABC):
    """Frozen condition components of a family; pure functions of the data (precomputable)."""

    timestep_sampling: TimestepSampling

    @classmethod
    @abstractmethod
    def from_pretrained(cls, root: str | Path, device: torch.device, dtype: torch.dtype) -> "ConditionModel": ...

    @abstractmethod
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Raw batch {"pixels": [B,C,F,H,W] in [-1,1], "caption": list[str]} -> conditions."""

    @abstractmethod
    def training_inputs(
        self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]
    ) -> dict[str, Any]:
        """Conditions + one generator per sample -> transformer forward kwargs + "target" + "sigmas"."""
