"""`train.objective: flow_matching` (DiTs, the default): the transformer's prediction against the flow-matching
target (the velocity, or the family's own target) as a per-sample mean squared error over the latent elements
the family counts (`loss_mask`), plus the same mean of each further output the family trains (LTX-2's audio
stream: `TrainingInputs.extra_targets`), optionally weighted by the noise level (`train.loss_weighting`). The task draws
the inputs (conditions, noise and sigmas from per-sample generators keyed on (seed, step, sample)); the loss is a
sum over samples that the trainer divides by the global batch's sample count."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from spindle.contracts.task import Objective, StepOutput


def loss_weights(sigmas: torch.Tensor, scheme: str) -> torch.Tensor | None:
    """SD3's loss weighting by noise level (`train.loss_weighting`); None: unweighted."""
    if scheme == "none":
        return None
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    weights: torch.Tensor = compute_loss_weighting_for_sd3(scheme, sigmas=sigmas)
    return weights


class FlowMatching(Objective):
    name = "flow_matching"

    def __init__(self, cfg: Any) -> None:
        self.loss_weighting = cfg.train.loss_weighting

    def build_loader(self, task: Any) -> Any:
        return task.media_loader()

    def loss_units(self, batch: dict[str, Any]) -> int:
        return len(batch["index"])  # the loss is a mean over samples

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, Any], step: int) -> StepOutput:
        inputs = task.training_inputs(model, batch, step)
        with task._autocast():
            outputs = model(**inputs.model_inputs, return_dict=False)
        target = inputs.target
        pred = task.condition.target_prediction(outputs[0], target)
        squared = F.mse_loss(pred.float(), target.float(), reduction="none")
        if inputs.loss_mask is None:
            per_sample = squared.flatten(1).mean(1)
        else:
            mask = inputs.loss_mask.to(squared).expand_as(squared)
            per_sample = (squared * mask).flatten(1).sum(1) / mask.flatten(1).sum(1)
        for index, extra in inputs.extra_targets.items():  # each stream's own mean: equal weights, whatever its size
            per_sample = per_sample + F.mse_loss(outputs[index].float(), extra.float(), reduction="none").flatten(
                1
            ).mean(1)
        weights = loss_weights(inputs.sigmas, self.loss_weighting)
        if weights is not None:
            per_sample = per_sample * weights.to(per_sample)
        return StepOutput(per_sample.sum(), inputs.samples, inputs.tokens_per_sample * inputs.samples)
