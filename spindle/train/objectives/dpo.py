"""Direct preference optimisation: the per-pair loss from summed completion log-probabilities.

Inputs per pair i: the policy's summed log-probability of the chosen and the rejected completion
(`logprobs.sequence_log_probs`), the reference model's (not for `simpo`), and each completion's token count.
With the log-ratios  c_i = logp(chosen) - ref_logp(chosen),  r_i = logp(rejected) - ref_logp(rejected):

- `sigmoid` (DPO): -(1 - ε) log σ(β (c_i - r_i)) - ε log σ(-β (c_i - r_i)), ε = `label_smoothing` (0: TRL's
  `DPOTrainer` loss_type "sigmoid"; ε > 0: conservative DPO, the form TRL's sigmoid losses take with label
  smoothing, e.g. `CPOTrainer.cpo_loss`);
- `ipo`: ((c_i / n_chosen - r_i / n_rejected) - 1 / (2β))², the log-ratios averaged per completion token as
  TRL's `DPOTrainer` "ipo" does (label smoothing does not apply);
- `simpo` (reference-free): the sigmoid form on the policy's *average* log-probabilities a_i (sum / tokens)
  with the target margin γ: -(1 - ε) log σ(β (a_c - a_r) - γ) - ε log σ(-(β (a_c - a_r) - γ)) (TRL's
  `CPOTrainer` with loss_type "simpo" and cpo_alpha 0).

`rpo_alpha` adds the chosen completions' negative log-likelihood, averaged over their tokens in the batch, times
rpo_alpha (TRL's loss_type ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]; the RPO paper's term).

Rewards (logged): β·c_i and β·r_i (simpo: β·a_c and β·a_r, as CPO logs them); margin = their difference;
accuracy = the share of pairs whose chosen reward beats the rejected one.

Units, for the trainer's global normalisation: the preference term is a mean over pairs (`pair_loss_sum` over
`pairs`); the NLL term is a mean over chosen completion tokens (`nll_sum` over `nll_tokens`). `loss` is both
normalised on this batch alone: TRL's loss for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

DPOLossType = Literal["sigmoid", "ipo", "simpo"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "simpo")


@dataclass
class DPOLoss:
    loss: torch.Tensor  # scalar: mean pair loss + rpo_alpha x mean chosen-token NLL, on this batch
    pair_losses: torch.Tensor  # [B] differentiable per-pair preference loss
    nll_sum: torch.Tensor  # differentiable sum of -log p over the chosen completion tokens (0 without rpo_alpha)
    nll_tokens: torch.Tensor  # chosen completion tokens
    chosen_rewards: torch.Tensor  # [B] detached
    rejected_rewards: torch.Tensor  # [B] detached

    @property
    def pair_loss_sum(self) -> torch.Tensor:
        return self.pair_losses.sum()

    @property
    def pairs(self) -> int:
        return int(self.pair_losses.shape[0])

    def metrics(self) -> dict[str, float]:
        """The batch's means, as TRL logs them: rewards/chosen, rewards/rejected, margin, accuracy."""
        margin = self.chosen_rewards - self.rejected_rewards
        return {
            "rewards/chosen": self.chosen_rewards.mean().item(),
            "rewards/rejected": self.rejected_rewards.mean().item(),
            "margin": margin.mean().item(),
            "accuracy": (margin > 0).float().mean().item(),
        }


def check_dpo_settings(loss_type: str, beta: float, label_smoothing: float, gamma: float) -> None:
    """The settings' own rules (the config validates the same; a direct caller gets the same message)."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo.loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"dpo.beta must be > 0; got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"dpo.label_smoothing must be in [0, 0.5); got {label_smoothing}")
    if label_smoothing and loss_type == "ipo":
        raise ValueError("dpo.label_smoothing does not apply to loss_type ipo (a squared loss); set it to 0")
    if gamma and loss_type != "simpo":
        raise ValueError(f"dpo.gamma is simpo's target margin; loss_type {loss_type} does not use it: set it to 0")


def _smoothed_sigmoid(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    gamma: float = 0.0,
    rpo_alpha: float | None = None,
) -> DPOLoss:
    """The preference loss of B pairs from [B] summed log-probabilities and token counts (module doc)."""
    check_dpo_settings(loss_type, beta, label_smoothing, gamma)
    chosen_n = chosen_tokens.to(chosen_logps.dtype).clamp(min=1.0)
    rejected_n = rejected_tokens.to(rejected_logps.dtype).clamp(min=1.0)
    if loss_type == "simpo":
        chosen_scores, rejected_scores = chosen_logps / chosen_n, rejected_logps / rejected_n
        losses = _smoothed_sigmoid(beta * (chosen_scores - rejected_scores) - gamma, label_smoothing)
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"dpo loss_type {loss_type} needs the reference model's log-probabilities")
        chosen_scores = chosen_logps - ref_chosen_logps
        rejected_scores = rejected_logps - ref_rejected_logps
        if loss_type == "sigmoid":
            losses = _smoothed_sigmoid(beta * (chosen_scores - rejected_scores), label_smoothing)
        else:  # ipo: the log-ratios per completion token (TRL's normalisation, confirmed with the IPO authors)
            losses = ((chosen_scores / chosen_n - rejected_scores / rejected_n) - 1 / (2 * beta)) ** 2
    nll_tokens = chosen_tokens.sum()
    nll_sum = -chosen_logps.sum() if rpo_alpha else chosen_logps.new_zeros(())
    loss = losses.mean()
    if rpo_alpha:
        loss = loss + rpo_alpha * nll_sum / nll_tokens.clamp(min=1)
    return DPOLoss(
        loss=loss,
        pair_losses=losses,
        nll_sum=nll_sum,
        nll_tokens=nll_tokens,
        chosen_rewards=(beta * chosen_scores).detach(),
        rejected_rewards=(beta * rejected_scores).detach(),
    )
