"""Reward models: the Bradley-Terry loss of a scalar head's scores on preference pairs.

Per pair i with scores s_c (chosen) and s_r (rejected), read at each sequence's last token:
-log σ(s_c - s_r - m_i), with m_i the pair's `margin` column when the data has one (and `reward.use_margin`),
else 0; plus, with `center_rewards_coefficient` κ, κ·mean((s_c + s_r)²) over the batch, which keeps the scores
centred on 0 (TRL's `RewardTrainer.compute_loss`, the same two terms).

Units: both terms are means over pairs (`pair_losses` sums to the trainer's loss sum over `pairs`).
Metrics: accuracy (share of pairs with s_c > s_r), margin (mean s_c - s_r), mean / min / max score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RewardLoss:
    loss: torch.Tensor  # scalar: the batch's mean
    pair_losses: torch.Tensor  # [B] differentiable, centring term included
    chosen_scores: torch.Tensor  # [B] detached
    rejected_scores: torch.Tensor  # [B] detached

    @property
    def pairs(self) -> int:
        return int(self.pair_losses.shape[0])

    def metrics(self) -> dict[str, float]:
        scores = torch.cat([self.chosen_scores, self.rejected_scores])
        margin = self.chosen_scores - self.rejected_scores
        return {
            "accuracy": (margin > 0).float().mean().item(),
            "margin": margin.mean().item(),
            "mean_reward": scores.mean().item(),
            "min_reward": scores.min().item(),
            "max_reward": scores.max().item(),
        }


def reward_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> RewardLoss:
    """The Bradley-Terry loss of [B] chosen and rejected scores (module doc)."""
    diff = chosen_scores - rejected_scores
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    losses = -F.logsigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen_scores + rejected_scores) ** 2
    return RewardLoss(losses.mean(), losses, chosen_scores.detach(), rejected_scores.detach())
