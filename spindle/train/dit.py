"""The flow-matching training task for DiT families: batch -> conditions -> inputs -> loss.

The family's condition model builds the transformer's inputs and target; the loss lives here so the
transformer stays a pure diffusers module whose `save_pretrained` is diffusers' own.
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from spindle.models.base import ConditionModel
from spindle.train.metrics import count_tokens


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


@dataclass
class StepOutput:
    loss: torch.Tensor  # mean over the micro-batch, differentiable
    samples: int
    tokens: int


class FlowMatchingTask:
    def __init__(
        self,
        condition: ConditionModel,
        transformer: torch.nn.Module,
        seed: int,
        loss_weighting: str = "none",
        autocast_dtype: torch.dtype | None = None,
    ):
        self.condition = condition
        self.transformer = transformer
        self.seed = seed
        self.loss_weighting = loss_weighting
        self.autocast_dtype = autocast_dtype

    def _autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def forward(self, batch: dict[str, Any], step: int, device: torch.device) -> StepOutput:
        conditions = self.condition.encode(batch)
        generators = [sample_generator(self.seed, step, int(i)) for i in batch["index"]]
        inputs = self.condition.training_inputs(conditions, generators)
        target = inputs.pop("target").to(device)
        sigmas = inputs.pop("sigmas")
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        patch = getattr(getattr(self.transformer, "config", None), "patch_size", 1)
        tokens_per_sample = count_tokens(inputs["hidden_states"], patch)
        self._check_sequence_split(tokens_per_sample, inputs)
        with self._autocast(device):
            pred = self.transformer(**inputs, return_dict=False)[0]
        per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").flatten(1).mean(1)
        weights = loss_weights(sigmas, self.loss_weighting)
        if weights is not None:
            per_sample = per_sample * weights.to(per_sample)
        return StepOutput(per_sample.mean(), len(generators), tokens_per_sample * len(generators))

    def _check_sequence_split(self, tokens: int, inputs: dict[str, Any]) -> None:
        """Ulysses SP splits sequences evenly; say so clearly instead of failing inside diffusers."""
        from spindle.distributed.context_parallel import (
            check_sequence_parallel,
            check_split_inputs,
            sequence_parallel_size,
        )

        sp = sequence_parallel_size(self.transformer)
        if sp > 1:
            check_sequence_parallel(self.transformer, sp, seq_len=tokens)
            check_split_inputs(self.transformer, sp, inputs)
