"""The post-training losses (spindle.train.objectives) equal TRL 1.16's on the same fixed tensors (fp32, 1e-6).

Where TRL's loss is a trainer method, the method itself runs on a stand-in object carrying the few attributes it
reads, with a stand-in model returning the fixed log-probabilities or scores (no training, no real model):
`DPOTrainer._compute_loss` (sigmoid, ipo, and RPO as loss_type ["sigmoid", "sft"]), `CPOTrainer.cpo_loss`
(simpo, and the label-smoothed sigmoid on DPO's log-ratios), `RewardTrainer.compute_loss`,
`GRPOTrainer._compute_loss` (grpo, dr_grpo, dapo; KL; clip ratios). GRPO's advantages are computed inline in
`GRPOTrainer._generate_and_score_completions` (with generation and reward calls), so that one reference is
TRL's code transcribed from trl/trainer/grpo_trainer.py (1.16.0, "sum_then_normalize") around TRL's own
`nanstd`. Gradients are compared too: a loss that matches in value but not in gradient trains differently.
"""

from __future__ import annotations

import os
import types
from collections import defaultdict

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPO lives in trl.experimental (simpo's reference)

from trl.experimental.cpo import CPOTrainer
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.reward_trainer import RewardTrainer
from trl.trainer.utils import nanstd

from spindle.ops.losses import linear_log_probs
from spindle.train.generation import completion_mask
from spindle.train.objectives.dpo import dpo_loss
from spindle.train.objectives.grpo import group_advantages, grpo_loss
from spindle.train.objectives.logprobs import sequence_log_probs, token_log_probs_from_logits
from spindle.train.objectives.reward import reward_loss

TOL = dict(rtol=1e-6, atol=1e-6)


def identity(x, *args, **kwargs):
    return x


def accelerator(**kw):
    return types.SimpleNamespace(
        device=torch.device("cpu"), gather=identity, gather_for_metrics=identity, reduce=identity, num_processes=1, **kw
    )


def metrics_store():
    return defaultdict(lambda: defaultdict(list))


# ---------------------------------------------------------------- DPO


def preference_batch(pairs=4, length=12, seed=0):
    """Fixed per-token log-probabilities [2B, L-1] (chosen rows, then rejected) on completion positions, the
    batch TRL's collator would give (completion_mask [2B, L]) and reference sums [B]."""
    g = torch.Generator().manual_seed(seed)
    completion_mask = torch.zeros(2 * pairs, length, dtype=torch.long)
    for row in range(2 * pairs):
        start = int(torch.randint(2, 5, (), generator=g))
        end = int(torch.randint(start + 1, length + 1, (), generator=g))
        completion_mask[row, start:end] = 1
    shift_mask = completion_mask[:, 1:]
    logps = (-torch.rand(2 * pairs, length - 1, generator=g) * 3) * shift_mask
    ref = -torch.rand(2, pairs, generator=g) * 20
    return logps, completion_mask, ref[0], ref[1]


def trl_dpo_loss(logps, completion_mask, ref_chosen, ref_rejected, loss_types, loss_weights, beta):
    """`DPOTrainer._compute_loss` on the fixed log-probabilities (precomputed reference log-probabilities)."""
    n = logps.shape[0]
    zeros = torch.zeros_like(logps)

    def model(**kwargs):
        """TRL's fused LM head's output: log-probabilities 0 (and without gradient) where the label is -100."""
        return types.SimpleNamespace(
            log_probs=logps * completion_mask[:, 1:],
            entropy=zeros,
            mean_logits=zeros,
            is_top1=zeros.bool(),
            aux_loss=None,
        )

    stand_in = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=loss_types,
        loss_weights=loss_weights,
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=metrics_store(),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(n, completion_mask.shape[1], dtype=torch.long),
        "attention_mask": torch.ones_like(completion_mask),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    loss = DPOTrainer._compute_loss(stand_in, model, inputs, return_outputs=False)
    return loss, {k: v[0] for k, v in stand_in._metrics["train"].items()}


def spindle_dpo(logps, completion_mask, ref_chosen, ref_rejected, **kw):
    labels = torch.where(completion_mask[:, 1:] == 1, 1, -100)  # only where a label is scored matters
    sums, tokens = sequence_log_probs(logps, labels)
    chosen, rejected = sums.chunk(2)
    chosen_n, rejected_n = tokens.chunk(2)
    return dpo_loss(chosen, rejected, chosen_n, rejected_n, ref_chosen, ref_rejected, **kw)


@pytest.mark.parametrize(
    "loss_type, rpo_alpha, trl_types, trl_weights",
    [
        ("sigmoid", None, ["sigmoid"], [1.0]),
        ("ipo", None, ["ipo"], [1.0]),
        ("sigmoid", 0.5, ["sigmoid", "sft"], [1.0, 0.5]),  # RPO
        ("ipo", 0.25, ["ipo", "sft"], [1.0, 0.25]),
    ],
)
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_equals_trl_dpo_trainer(loss_type, rpo_alpha, trl_types, trl_weights, beta):
    logps, completion_mask, ref_c, ref_r = preference_batch()
    theirs_in = logps.clone().requires_grad_(True)
    theirs, trl_metrics = trl_dpo_loss(theirs_in, completion_mask, ref_c, ref_r, trl_types, trl_weights, beta)
    ours_in = logps.clone().requires_grad_(True)
    ours = spindle_dpo(ours_in, completion_mask, ref_c, ref_r, beta=beta, loss_type=loss_type, rpo_alpha=rpo_alpha)
    torch.testing.assert_close(ours.loss, theirs, **TOL)
    theirs.backward()
    ours.loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)
    metrics = ours.metrics()
    for ours_key, trl_key in [
        ("rewards/chosen", "rewards/chosen"),
        ("rewards/rejected", "rewards/rejected"),
        ("margin", "rewards/margins"),
        ("accuracy", "rewards/accuracies"),
    ]:
        assert metrics[ours_key] == pytest.approx(trl_metrics[trl_key], abs=1e-6), ours_key
    # the trainer's split: pair mean + rpo_alpha x chosen-token mean, from the sums and their units
    split = ours.pair_loss_sum / ours.pairs + (rpo_alpha or 0) * ours.nll_sum / ours.nll_tokens
    torch.testing.assert_close(split, ours.loss, **TOL)


def cpo_loss(chosen, rejected, loss_type, beta, label_smoothing, gamma=0.0):
    stand_in = types.SimpleNamespace(
        alpha=0.0,
        loss_type=loss_type,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=gamma,
        accelerator=accelerator(),
    )
    return CPOTrainer.cpo_loss(stand_in, chosen, rejected)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("gamma", [0.0, 0.7])
def test_simpo_equals_trl_cpo_simpo(label_smoothing, gamma):
    """SimPO is TRL's CPO with loss_type simpo on length-averaged log-probabilities (cpo_alpha 0)."""
    logps, completion_mask, _, _ = preference_batch(seed=1)
    beta = 2.0
    shift_mask = completion_mask[:, 1:]
    theirs_in = logps.clone().requires_grad_(True)
    average = (theirs_in * shift_mask).sum(dim=1) / shift_mask.sum(dim=1)  # CPO's get_batch_logps(average=True)
    losses, chosen_rewards, rejected_rewards = cpo_loss(*average.chunk(2), "simpo", beta, label_smoothing, gamma)
    ours_in = logps.clone().requires_grad_(True)
    ours = spindle_dpo(
        ours_in, completion_mask, None, None, beta=beta, loss_type="simpo", label_smoothing=label_smoothing, gamma=gamma
    )
    torch.testing.assert_close(ours.loss, losses.mean(), **TOL)
    losses.mean().backward()
    ours.loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)
    torch.testing.assert_close(ours.chosen_rewards, chosen_rewards, **TOL)
    torch.testing.assert_close(ours.rejected_rewards, rejected_rewards, **TOL)


def test_label_smoothed_dpo_equals_trl_smoothed_sigmoid():
    """Label smoothing (conservative DPO): TRL's smoothed sigmoid (`CPOTrainer.cpo_loss`, loss_type sigmoid) on
    DPO's log-ratios (TRL 1.16's DPOTrainer has no label-smoothed sigmoid; its 0.x versions had this form)."""
    logps, completion_mask, ref_c, ref_r = preference_batch(seed=2)
    beta, smoothing = 0.3, 0.1
    theirs_in = logps.clone().requires_grad_(True)
    chosen, rejected = (theirs_in * completion_mask[:, 1:]).sum(dim=1).chunk(2)
    losses, _, _ = cpo_loss(chosen - ref_c, rejected - ref_r, "sigmoid", beta, smoothing)
    ours_in = logps.clone().requires_grad_(True)
    ours = spindle_dpo(ours_in, completion_mask, ref_c, ref_r, beta=beta, label_smoothing=smoothing)
    torch.testing.assert_close(ours.loss, losses.mean(), **TOL)
    losses.mean().backward()
    ours.loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(loss_type="ipo", label_smoothing=0.1), "label_smoothing does not apply to loss_type ipo"),
        (dict(loss_type="sigmoid", gamma=0.5), "gamma is simpo's target margin"),
        (dict(loss_type="hinge"), "must be one of sigmoid, ipo, simpo"),
        (dict(beta=0.0), "beta must be > 0"),
    ],
)
def test_dpo_refuses_settings_that_do_not_apply(kw, message):
    logps, completion_mask, ref_c, ref_r = preference_batch()
    with pytest.raises(ValueError, match=message):
        spindle_dpo(logps, completion_mask, ref_c, ref_r, **kw)


# ---------------------------------------------------------------- reward


@pytest.mark.parametrize("with_margin", [False, True])
@pytest.mark.parametrize("center", [None, 0.01])
def test_reward_loss_equals_trl_reward_trainer(with_margin, center):
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(12, 1, generator=g) * 2
    margin = torch.rand(6, generator=g) if with_margin else None
    theirs_in = scores.clone().requires_grad_(True)
    stand_in = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=accelerator(),
        args=types.SimpleNamespace(center_rewards_coefficient=center),
        _metrics=metrics_store(),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {"input_ids": torch.ones(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3, dtype=torch.long)}
    if margin is not None:
        inputs["margin"] = margin
    theirs = RewardTrainer.compute_loss(stand_in, lambda **kw: types.SimpleNamespace(logits=theirs_in), inputs)
    ours_in = scores.clone().requires_grad_(True)
    chosen, rejected = ours_in.squeeze(-1).chunk(2)
    ours = reward_loss(chosen, rejected, margin, center_rewards_coefficient=center)
    torch.testing.assert_close(ours.loss, theirs, **TOL)
    theirs.backward()
    ours.loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)
    trl_metrics = {k: v[0] for k, v in stand_in._metrics["train"].items()}
    for key in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert ours.metrics()[key] == pytest.approx(trl_metrics[key], abs=1e-6), key


# ---------------------------------------------------------------- GRPO


def trl_advantages(rewards_per_func, weights, num_generations, scale_rewards):
    """trl/trainer/grpo_trainer.py 1.16.0 `_generate_and_score_completions`, "sum_then_normalize", transcribed."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    elif scale_rewards == "batch":
        std_rewards = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    return torch.nan_to_num(advantages, nan=0.0), is_std_zero


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("num_generations", [1, 4])
def test_group_advantages_equal_trl(scale_rewards, num_generations):
    g = torch.Generator().manual_seed(4)
    rewards = torch.randn(16, 2, generator=g)
    rewards[:4, 0] = 1.0  # a group with one function constant
    rewards[4:8] = 0.5  # a group whose rewards are all equal: advantage 0, std 0
    rewards[9, 1] = torch.nan  # a function that did not score a completion
    rewards[10] = torch.nan  # a completion no function scored
    weights = torch.tensor([1.0, 0.5])
    ours = group_advantages(rewards, num_generations, weights, scale_rewards)
    expected, std_zero = trl_advantages(rewards, weights, num_generations, scale_rewards)
    torch.testing.assert_close(ours.advantages, expected, **TOL)
    assert torch.equal(ours.std_is_zero, std_zero)
    if num_generations == 4 and scale_rewards != "none":
        assert torch.all(ours.advantages[4:8] == 0)


def completion_batch(seed=5, completions=6, length=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(completions, length, dtype=torch.long)
    for row, end in enumerate(torch.randint(1, length + 1, (completions,), generator=g).tolist()):
        mask[row, end:] = 0  # after EOS
    logps = -torch.rand(completions, length, generator=g) * 2
    old = logps + torch.randn(completions, length, generator=g) * 0.3  # some ratios far enough out to be clipped
    ref = logps + torch.randn(completions, length, generator=g) * 0.2
    advantages = torch.randn(completions, generator=g)
    return logps, old, ref, advantages, mask


def trl_grpo_loss(logps, inputs, loss_type, epsilon, epsilon_high, beta, max_completion_length):
    """`GRPOTrainer._compute_loss` with the policy's forward replaced by the fixed log-probabilities."""
    stand_in = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logps, torch.zeros_like(logps), None),
        model=types.SimpleNamespace(training=True),
        accelerator=accelerator(),
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length,
        _entropy_bonus_enabled=False,
        _metrics=metrics_store(),
    )
    loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, {k: v[0] for k, v in stand_in._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("epsilon_high", [None, 0.28])
@pytest.mark.parametrize("with_old", [True, False])
def test_grpo_loss_equals_trl_grpo_trainer(loss_type, beta, epsilon_high, with_old):
    logps, old, ref, advantages, mask = completion_batch()
    epsilon, max_len = 0.2, 9
    inputs = {
        "prompt_ids": torch.ones(6, 3, dtype=torch.long),
        "prompt_mask": torch.ones(6, 3, dtype=torch.long),
        "completion_ids": torch.ones_like(mask),
        "completion_mask": mask,
        "advantages": advantages,
        "num_items_in_batch": mask.sum(),
    }
    if with_old:
        inputs["old_per_token_logps"] = old
    if beta:
        inputs["ref_per_token_logps"] = ref
    theirs_in = logps.clone().requires_grad_(True)
    theirs, trl_metrics = trl_grpo_loss(
        theirs_in, inputs, loss_type, epsilon, epsilon if epsilon_high is None else epsilon_high, beta, max_len
    )
    ours_in = logps.clone().requires_grad_(True)
    ours = grpo_loss(
        ours_in,
        advantages,
        mask,
        old if with_old else None,
        ref if beta else None,
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        loss_type=loss_type,
        max_completion_length=max_len,
    )
    torch.testing.assert_close(ours.loss, theirs, **TOL)
    theirs.backward()
    ours.loss.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)
    metrics = ours.metrics()
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", *(["kl"] if beta else [])):
        assert metrics[key] == pytest.approx(trl_metrics[key], abs=1e-6), key
    if with_old:
        assert metrics["clip_ratio/region_mean"] > 0  # the batch exercises the clipping
    torch.testing.assert_close(ours.loss_sum / ours.units, ours.loss, **TOL)


def test_completion_mask_ends_at_the_first_stop_token_as_trl():
    """trl/trainer/grpo_trainer.py 1.16.0 `_generate_single_turn` (transformers generation), transcribed."""
    ids = torch.tensor([[5, 6, 2, 7, 2], [5, 9, 9, 9, 9], [3, 5, 5, 5, 5], [1, 1, 1, 3, 0]])
    eos_token_ids = [2, 3]
    is_eos = torch.isin(ids, torch.tensor(eos_token_ids))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    expected = (torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1) <= eos_idx.unsqueeze(1)).int()
    ours = completion_mask(ids, eos_token_ids)
    assert torch.equal(ours, expected)
    assert ours.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]


# ---------------------------------------------------------------- per-token log-probabilities


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 1024])
def test_chunked_log_probs_equal_trl_selective_log_softmax(temperature, chunk_size):
    """`linear_log_probs` (chunked, logits never whole) equals TRL's `selective_log_softmax` on full logits,
    values and gradients for the hidden states, the head weight and bias."""
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(11, 8, generator=g)
    bias = torch.randn(11, generator=g)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    labels[0, :2] = -100
    upstream = torch.randn(2, 5, generator=g)

    ours_params = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ours = linear_log_probs(
        *ours_params[:2], labels, bias=ours_params[2], chunk_size=chunk_size, temperature=temperature
    )
    theirs_params = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logits = torch.nn.functional.linear(theirs_params[0], theirs_params[1], theirs_params[2])
    theirs = selective_log_softmax(logits, labels.clamp(min=0), temperature=temperature) * (labels != -100)
    torch.testing.assert_close(ours, theirs, **TOL)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    for a, b in zip(ours_params, theirs_params, strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL)
    torch.testing.assert_close(token_log_probs_from_logits(logits, labels, temperature), theirs, **TOL)
