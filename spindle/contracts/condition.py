"""The condition-model contract of a DiT family: its frozen components (text encoders, VAE, scheduler),
never sharded, whose `encode` is a pure function of the data (so `spindle precompute` can cache it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch


class ConditionModel(ABC):
    """Frozen condition components of a family; pure functions of the data (precomputable)."""

    # how training draws sigmas (the job's `train.timestep`, a `spindle.config.TimestepConfig`)
    timestep_sampling: Any
    # the sigmas training draws are mapped into [low, high] (a two-expert family's trained expert's range)
    sigma_range: tuple[float, float] = (0.0, 1.0)

    @classmethod
    def trained_component(cls, model_index: dict[str, Any], expert: str | None) -> str:
        """The checkpoint component a run trains, for `train.expert` (checked before launch). Default: a
        single-transformer family, which takes no expert."""
        if expert is not None:
            raise ValueError(
                f"train.expert={expert!r}: this checkpoint has one transformer (no experts); remove train.expert"
            )
        return "transformer"

    def select_expert(self, expert: str) -> None:
        """Train the expert `expert` of a two-expert checkpoint: set `sigma_range` to its timesteps."""
        raise ValueError(f"train.expert={expert!r}: this checkpoint has one transformer (no experts)")

    @classmethod
    @abstractmethod
    def from_pretrained(
        cls,
        root: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_text_length: int = 512,
        encoders: bool = True,
    ) -> ConditionModel:
        """`encoders=False`: for training on precomputed conditions; only what `training_inputs` needs
        is loaded (never the text encoders' or the VAE's weights), and `encode` cannot run."""

    @abstractmethod
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Raw batch {"pixels": [B,C,F,H,W] in [-1,1], "caption": list[str]} -> conditions."""

    @abstractmethod
    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        """Conditions + one generator per sample -> transformer forward kwargs + "target" + "sigmas" (+ an
        optional "loss_mask", broadcastable to the target: 1 where the loss counts)."""
