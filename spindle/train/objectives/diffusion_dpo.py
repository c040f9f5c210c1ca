"""Diffusion-DPO (Wallace et al. 2023) in its flow-matching form, as pure functions.

A preference pair (chosen, rejected) for one prompt is noised with the same noise and the same sigma;
each member's error is the per-sample mean squared error of the velocity prediction against the
flow-matching target (noise - x0). With the policy's errors e and the reference's e_ref:

    inside = -beta / 2 * ((e_chosen - e_ref_chosen) - (e_rejected - e_ref_rejected))
    loss   = -log sigmoid(inside)

`inside` is the pair's implicit reward margin (the chosen sample's implicit reward -beta/2 * (e - e_ref)
minus the rejected one's); the implicit accuracy is the fraction of pairs where it is positive.

Same noise and sigma for both members: the task draws them from two generators made with the same key
(`pair_generators`), so each member's `training_inputs` draws the same sigma and noise as the other's
(equal latent shapes: the members of a pair share a bucket).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DiffusionDpoLoss:
    """Per pair ([P]): `loss`; `margin`, the implicit reward margin (the term inside the sigmoid);
    `accurate`, 1.0 where the margin is positive (the implicit accuracy's numerator)."""

    loss: torch.Tensor
    margin: torch.Tensor
    accurate: torch.Tensor


def per_sample_error(pred: torch.Tensor, target: torch.Tensor, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample ([B]) in float32, over the elements `loss_mask` keeps (all without one)."""
    squared = F.mse_loss(pred.float(), target.float(), reduction="none")
    if loss_mask is None:
        return squared.flatten(1).mean(1)
    mask = loss_mask.to(squared).expand_as(squared)
    return (squared * mask).flatten(1).sum(1) / mask.flatten(1).sum(1)


def diffusion_dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> DiffusionDpoLoss:
    """The loss of each pair from the per-sample errors ([P] each, `per_sample_error`) of the policy and of
    the reference on the pair's chosen and rejected members (the reference's carry no gradient)."""
    shapes = {tuple(t.shape) for t in (chosen, rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or chosen.ndim != 1:
        raise ValueError(f"the four per-pair errors must be vectors of one length; got shapes {sorted(shapes)}")
    margin = -0.5 * beta * ((chosen - ref_chosen.detach()) - (rejected - ref_rejected.detach()))
    return DiffusionDpoLoss(loss=-F.logsigmoid(margin), margin=margin.detach(), accurate=(margin.detach() > 0).float())


def pair_generators(
    make: Callable[[int, int, int], torch.Generator], seed: int, step: int, pair_indices: Sequence[int]
) -> tuple[list[torch.Generator], list[torch.Generator]]:
    """Two lists of per-sample generators for the chosen and the rejected members, made with the same key
    (seed, step, pair index) by `make` (the trainer's per-sample generator): each member draws the same
    sigma and noise as the other, and any layout draws what one process draws."""
    return [make(seed, step, int(i)) for i in pair_indices], [make(seed, step, int(i)) for i in pair_indices]
