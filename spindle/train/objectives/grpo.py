"""GRPO: group-relative advantages and the clipped policy objective, on per-token log-probabilities.

Advantages (TRL's `GRPOTrainer`, multi_objective_aggregation "sum_then_normalize"): the rewards of the N =
prompts x `num_generations` completions, one column per reward function, are weighted and summed per completion
(a function that returned no value for a completion, NaN, is left out of its sum; a completion no function
scored is left out of the statistics and gets advantage 0). Each completion's advantage is its reward minus its
group's mean (the completions of the same prompt, consecutive), divided by `scale_rewards`'s standard
deviation (unbiased) + 1e-4: "group" that of its group, "batch" that of all N rewards, "none" no division.

The objective per completion token t (TRL's `_compute_loss`, token-level importance sampling):
  ratio_t = exp(logp_t - old_logp_t)   (old: the log-probabilities the completions were sampled with; the same
                                        as logp, detached, for the first of `num_iterations` updates)
  loss_t  = -min(ratio_t A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t
  kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1   (k3, an unbiased estimator of KL(policy || ref) >= 0)
and the batch's loss by `loss_type`, with m the completion-token mask:
  grpo:    mean over completions of (sum_t loss_t m_t / sum_t m_t)   units: completions
  dr_grpo: sum loss_t m_t / (completions x max_completion_length)   units: completions
  dapo:    sum loss_t m_t / sum m_t                                  units: completion tokens
`loss_sum` / `units` are those sums and counts (the trainer divides by the global count: DAPO's "tokens of the
global batch"); `loss` is the batch's own ratio, TRL's loss for one batch.

Clip ratios (logged): the share of completion tokens whose ratio is below 1 - epsilon with A < 0 (low), above
1 + epsilon_high with A > 0 (high), either (region): the tokens where clipping removed the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

GRPOLossType = Literal["grpo", "dr_grpo", "dapo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: added to the standard deviation, so a group of equal rewards gives advantages 0


def nan_std(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased standard deviation ignoring NaNs (NaN for fewer than two values), as `trl.trainer.utils.nanstd`."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze(dim) if dim is not None else std.reshape(())


@dataclass
class Advantages:
    advantages: torch.Tensor  # [N]
    rewards: torch.Tensor  # [N] weighted sums (NaN where no function scored the completion)
    std_is_zero: torch.Tensor  # [N] bool: the scale was 0 (a group whose rewards are all equal)


def group_advantages(
    rewards_per_function: torch.Tensor,
    num_generations: int,
    weights: torch.Tensor | None = None,
    scale_rewards: str = "group",
) -> Advantages:
    """Advantages of N completions from their rewards [N, F] (module doc); N = prompts x num_generations."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"grpo.scale_rewards must be one of {', '.join(SCALE_REWARDS)}; got {scale_rewards!r}")
    if rewards_per_function.dim() != 2 or rewards_per_function.shape[0] % num_generations:
        raise ValueError(
            f"rewards must be [completions, functions] with completions a multiple of num_generations="
            f"{num_generations}; got {tuple(rewards_per_function.shape)}"
        )
    if weights is None:
        weights = torch.ones(rewards_per_function.shape[1], dtype=rewards_per_function.dtype)
    unscored = torch.isnan(rewards_per_function).all(dim=1)
    rewards = (rewards_per_function * weights.to(rewards_per_function).unsqueeze(0)).nansum(dim=1)
    rewards[unscored] = torch.nan
    groups = rewards.view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nan_std(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nan_std(groups, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + STD_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    return Advantages(advantages, rewards, torch.isclose(std, torch.zeros_like(std)))


@dataclass
class GRPOLoss:
    loss: torch.Tensor  # scalar: loss_sum / units of this batch (TRL's loss)
    loss_sum: torch.Tensor  # differentiable sum over this batch's units
    units: torch.Tensor  # completions (grpo, dr_grpo) or completion tokens (dapo)
    tokens: torch.Tensor  # completion tokens (the clip ratios' and kl's denominator)
    kl_sum: torch.Tensor | None  # sum of kl_t over completion tokens (beta > 0)
    clipped_low: torch.Tensor  # completion tokens clipped below (counts)
    clipped_high: torch.Tensor

    def metrics(self) -> dict[str, float]:
        tokens = self.tokens.clamp(min=1).item()
        out = {
            "clip_ratio/low_mean": self.clipped_low.item() / tokens,
            "clip_ratio/high_mean": self.clipped_high.item() / tokens,
            "clip_ratio/region_mean": (self.clipped_low + self.clipped_high).item() / tokens,
        }
        if self.kl_sum is not None:
            out["kl"] = self.kl_sum.item() / tokens
        return out


def check_grpo_settings(loss_type: str, epsilon: float, epsilon_high: float | None, beta: float) -> None:
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"grpo.loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}; got {loss_type!r}")
    if epsilon <= 0 or (epsilon_high is not None and epsilon_high <= 0):
        raise ValueError(f"grpo.epsilon and grpo.epsilon_high must be > 0; got {epsilon}, {epsilon_high}")
    if beta < 0:
        raise ValueError(f"grpo.beta must be >= 0; got {beta}")


def grpo_loss(
    per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    old_per_token_logps: torch.Tensor | None = None,
    ref_per_token_logps: torch.Tensor | None = None,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
) -> GRPOLoss:
    """The clipped objective of B completions: per-token log-probabilities [B, T] under the policy being trained,
    advantages [B], the completion-token mask [B, T] (module doc)."""
    check_grpo_settings(loss_type, epsilon, epsilon_high, beta)
    high = epsilon if epsilon_high is None else epsilon_high
    mask = completion_mask.to(per_token_logps.dtype)
    old = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    ratio = torch.exp(per_token_logps - old)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    kl_sum = None
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("grpo.beta > 0 needs the reference model's per-token log-probabilities")
        delta = ref_per_token_logps - per_token_logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
        kl_sum = (kl.detach() * mask).sum()
    tokens = mask.sum()
    completions = torch.tensor(float(per_token.shape[0]), dtype=per_token.dtype, device=per_token.device)
    masked = per_token * mask
    if loss_type == "grpo":
        loss_sum = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        units = completions
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("grpo loss_type dr_grpo normalises by max_completion_length (grpo.max_new_tokens)")
        loss_sum = masked.sum() / max_completion_length
        units = completions
    else:  # dapo
        loss_sum = masked.sum()
        units = tokens
    with torch.no_grad():
        low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)
        high_clipped = ((ratio > 1 + high) & (adv > 0)).to(mask.dtype)
    return GRPOLoss(
        loss=loss_sum / units.clamp(min=1.0),
        loss_sum=loss_sum,
        units=units,
        tokens=tokens,
        kl_sum=kl_sum,
        clipped_low=(low * mask).sum(),
        clipped_high=(high_clipped * mask).sum(),
    )
