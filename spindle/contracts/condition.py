"""The condition-model contract of a DiT family: its frozen components (text encoders, VAE, scheduler),
never sharded, whose `encode` is a pure function of the data (so `spindle precompute` can cache it)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.protocols import TimestepSamplingLike


@dataclass(frozen=True)
class PixelGrid:
    """The pixel shapes a family's training inputs can take, read from a checkpoint's configs: height and
    width multiples (VAE downsampling x the transformer's patch or packing), and the frame-count rule
    `frames = k * frame_multiple + 1` of a video family (None: an image family, one frame)."""

    height: int
    width: int
    frame_multiple: int | None = None

    def frame_counts(self, most: int) -> list[int]:
        """Every frame count the family takes, up to `most` (1 for an image family)."""
        if self.frame_multiple is None:
            return [1]
        return list(range(1, most + 1, self.frame_multiple))


@dataclass(frozen=True)
class AudioTrack:
    """The soundtrack a family trains on with `data.audio` (read from a checkpoint's configs): the waveform's
    sample rate and channel count its audio encoder takes, and the video frame rate that gives a clip of
    `frames` frames its duration, `frames / frame_rate` seconds (the length of the sound trained with it)."""

    sample_rate: int
    channels: int
    frame_rate: float

    def samples(self, frames: int) -> int:
        """The waveform length of a clip of `frames` video frames."""
        return round(frames / self.frame_rate * self.sample_rate)


class ConditionModel(ABC):
    """Frozen condition components of a family; pure functions of the data (precomputable)."""

    # what `encode` writes, as a number: bump it when the encoding changes, so that `spindle precompute`
    # caches made before are refused (spindle.data.precomputed.cache_settings) instead of read as current
    encoding_version: int = 1

    # how training draws sigmas (the job's `train.timestep`, a `spindle.config.TimestepConfig`)
    timestep_sampling: TimestepSamplingLike
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

    @classmethod
    def pixel_grid(cls, root: str | Path) -> PixelGrid:
        """The checkpoint's pixel grid (data.buckets), from its configs alone (no weight is read)."""
        raise NotImplementedError(f"{cls.__name__} declares no pixel grid, which data.buckets needs")

    @classmethod
    def audio_track(cls, root: str | Path) -> AudioTrack:
        """The soundtrack `data.audio` trains on with this checkpoint (checked before launch). Default: a
        family without an audio stream, which refuses it."""
        raise ValueError(f"data.audio: {cls.__name__} has no audio stream to train; remove data.audio")

    @classmethod
    def request_images(cls, root: str | Path) -> tuple[int, int] | None:
        """How many conditioning images a request to this checkpoint takes (least, most), from its configs
        alone, where the checkpoint narrows the family's `options.images` (a first-last-frame Wan needs
        two); None: the family's bounds. Checked before launch for `train.validation.images`."""
        return None

    def target_prediction(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The part of the transformer's output that the loss compares with `target`. Edit families append
        their reference images' tokens to the noisy latents' on the sequence axis and learn only the first
        `target.shape[1]` (as their pipelines keep `noise_pred[:, : latents.size(1)]`). Default: all of it."""
        return pred

    def tokens_per_sample(self, inputs: dict[str, Any]) -> int | None:
        """The transformer's image tokens per sample for these `training_inputs` (metrics, the SP split check);
        None: counted from `inputs["hidden_states"]` (packed [B, L, C], or [B, C, *spatial] over the patch).
        A transformer taking other inputs (Z-Image's per-sample lists) counts its own."""
        return None
