"""Flow-GRPO's sampler step, advantages and clipped objective (spindle/train/objectives/flow_grpo.py) against
independent computations: torch's Normal log-density, diffusers' FlowMatchEulerDiscreteScheduler.step, and the
reference repository's formulas written out here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from spindle.train.objectives.flow_grpo import (
    clipped_policy_loss,
    group_advantages,
    logprob_mismatch,
    rollout_generators,
    sde_step,
    train_step_indices,
)

STEPS = 4


def schedule(steps: int = STEPS) -> FlowMatchEulerDiscreteScheduler:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    return scheduler


def seeded(seed: int, count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(count)]


class Velocity(torch.nn.Module):
    """A small denoiser standing in for a transformer: v = f(x, sigma)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(9, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        s = sigma.view(-1, 1, 1).expand(*x.shape[:2], 1)
        return self.net(torch.cat([x, s], dim=-1))


def test_sde_step_log_prob_is_the_gaussian_density_of_the_reference_sde():
    """Mean and std written out as flow_grpo's `sde_step_with_logprob` defines them; the log-prob is torch's
    Normal(mean, std * sqrt(-dt)).log_prob averaged over all but the batch dim; the draw is mean + scale * eps
    with eps from each sample's own generator."""
    scheduler = schedule()
    torch.manual_seed(1)
    sample = torch.randn(3, 6, 8)
    velocity = torch.randn(3, 6, 8)
    noise_level = 0.7
    for i, t in enumerate(scheduler.timesteps):
        step = sde_step(velocity, sample, scheduler.sigmas, i, noise_level, generators=seeded(10 * i, 3))
        index = scheduler.index_for_timestep(t)
        sigma, sigma_prev = scheduler.sigmas[index], scheduler.sigmas[index + 1]
        sigma_max = scheduler.sigmas[1]
        dt = sigma_prev - sigma
        std_dev_t = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
        mean = (
            sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        scale = std_dev_t * math.sqrt(-dt)
        eps = torch.stack([torch.randn(6, 8, generator=g) for g in seeded(10 * i, 3)])
        torch.testing.assert_close(step.prev_sample, mean + scale * eps, rtol=0, atol=1e-6)
        expected = torch.distributions.Normal(mean, scale).log_prob(step.prev_sample).mean(dim=(1, 2))
        assert step.log_prob is not None
        torch.testing.assert_close(step.log_prob, expected, rtol=0, atol=1e-5)


def test_noise_level_zero_is_the_schedulers_euler_step():
    scheduler = schedule(5)
    model = Velocity()
    torch.manual_seed(2)
    ours = theirs = torch.randn(2, 6, 8)
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            sigma = scheduler.sigmas[i].expand(2)
            step = sde_step(model(ours, sigma), ours, scheduler.sigmas, i, noise_level=0.0)
            assert step.log_prob is None
            ours = step.prev_sample
            theirs = scheduler.step(model(theirs, sigma), t, theirs, return_dict=False)[0]
            assert torch.equal(ours, theirs), f"step {i}"


def rollout(model: Velocity, generators: list[torch.Generator], noise_level: float):
    """A whole SDE rollout, as the engine's denoising loop runs one with the recorder in place of
    `scheduler.step`: initial noise and every step's draw from the samples' generators."""
    from spindle.train.objectives.flow_grpo import SdeRecorder, draw_noise

    scheduler = schedule()
    recorder = SdeRecorder(noise_level, generators)
    latents = draw_noise((len(generators), 6, 8), generators)
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            noise_pred = model(latents, scheduler.sigmas[i].expand(len(latents)))
            latents = recorder(scheduler, noise_pred, t, i, latents)
    trajectory = recorder.trajectory()
    assert torch.equal(trajectory.latents[:, -1], latents)
    return scheduler, trajectory


def test_recorded_log_probs_are_recomputed_exactly_and_rollouts_are_keyed_per_sample():
    """What the trainer does before its first update: recompute each recorded transition's log-prob with the
    same weights, here one sample at a time (another batch composition than the rollout's): the mismatch the
    issue logs stays <= 1e-5; and a sample's rollout does not depend on the batch it was generated in."""
    model = Velocity()

    def make(seed: int, step: int, key: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 1000 + step * 100 + key)

    scheduler, traj = rollout(model, rollout_generators(make, 7, 3, [0, 1], 2), noise_level=0.8)
    recorded, latents = traj.log_probs, traj.latents
    assert recorded.shape == (4, STEPS) and latents.shape == (4, STEPS + 1, 6, 8) and torch.isfinite(recorded).all()
    assert traj.step_indices == list(range(STEPS))
    recomputed = torch.empty_like(recorded)
    with torch.no_grad():
        for b in range(4):
            for j in range(STEPS):
                x = latents[b : b + 1, j]
                v = model(x, scheduler.sigmas[j].view(1))
                step = sde_step(v, x, scheduler.sigmas, j, 0.8, prev_sample=latents[b : b + 1, j + 1])
                recomputed[b, j] = step.log_prob[0]
        assert logprob_mismatch(recorded, recomputed) <= 1e-5
        # the same batch recomputed through the trajectory: the very same numbers
        same = torch.stack(
            [
                traj.transition_log_prob(model(latents[:, j], scheduler.sigmas[j].expand(4)), j, 0.8).log_prob
                for j in range(STEPS)
            ],
            1,
        )
    assert logprob_mismatch(recorded, same) == 0.0
    # prompt 1's samples generated alone equal rows 2-3 of the batched rollout
    _, alone = rollout(model, [make(7, 3, 1 * 2 + s) for s in range(2)], noise_level=0.8)
    torch.testing.assert_close(alone.latents, latents[2:], rtol=0, atol=1e-6)
    torch.testing.assert_close(alone.log_probs, recorded[2:], rtol=0, atol=1e-5)
    # another step draws other noise
    _, other = rollout(model, rollout_generators(make, 7, 4, [0, 1], 2), noise_level=0.8)
    assert not torch.allclose(other.latents, latents)


def test_recorder_refuses_latents_changed_between_steps():
    from spindle.train.objectives.flow_grpo import SdeRecorder

    scheduler = schedule()
    recorder = SdeRecorder(0.7, seeded(0, 1))
    x = torch.zeros(1, 4)
    nxt = recorder(scheduler, x, scheduler.timesteps[0], 0, x)
    with pytest.raises(RuntimeError, match="step 1 starts from other latents than step 0 returned"):
        recorder(scheduler, x, scheduler.timesteps[1], 1, nxt + 1)
    with pytest.raises(ValueError, match="noise_level must be > 0"):
        SdeRecorder(0.0, seeded(0, 1))


def test_sde_step_refuses_a_rollout_without_a_generator_per_sample():
    scheduler = schedule()
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="one generator per sample: 2 samples, 1 generators"):
        sde_step(x, x, scheduler.sigmas, 0, 0.7, generators=seeded(0, 1))
    with pytest.raises(ValueError, match="outside the schedule's 4 steps"):
        sde_step(x, x, scheduler.sigmas, 4, 0.7, prev_sample=x)


def test_group_advantages_are_flow_grpos_per_prompt_normalisation():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 4.0, 4.0, 4.0, 4.0])
    got = group_advantages(rewards, num_generations=4)
    r = rewards.numpy().astype(np.float64).reshape(2, 4)
    expected = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(got.numpy(), expected.reshape(-1), rtol=1e-6)
    assert torch.equal(got[4:], torch.zeros(4))  # equal rewards: nothing to learn from the group
    glob = group_advantages(rewards, num_generations=4, global_std=True)
    np.testing.assert_allclose(glob.numpy(), ((r - r.mean(1, keepdims=True)) / (r.std() + 1e-4)).reshape(-1), rtol=1e-6)
    with pytest.raises(ValueError, match="num_prompts x 3"):
        group_advantages(rewards, num_generations=3)


def test_clipped_objective_matches_flow_grpos_loss_and_clips():
    """The lines of flow_grpo's train_sd3.py, written out: clamp advantages, ratio, max of the unclipped and
    clipped losses, KL of the step means over 2 std^2; a ratio past the clip gets no gradient."""
    log_prob = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.5, -1.1])
    adv = torch.tensor([1.0, 2.0, -3.0, 9.0])
    torch.manual_seed(3)
    mean, ref_mean = torch.randn(4, 5, 3), torch.randn(4, 5, 3)
    std = torch.rand(4, 1, 1) + 0.1
    out = clipped_policy_loss(
        log_prob, old, adv, clip_range=0.2, adv_clip_max=5.0, beta=0.04, mean=mean, ref_mean=ref_mean, std_dev_t=std
    )
    a = torch.clamp(adv, -5.0, 5.0)
    ratio = torch.exp(log_prob.detach() - old)
    policy = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    kl = ((mean - ref_mean) ** 2).mean(dim=(1, 2), keepdim=True) / (2 * std**2)
    torch.testing.assert_close(out.policy_loss.detach(), policy)
    torch.testing.assert_close(out.kl, kl.view(-1))
    torch.testing.assert_close(out.loss.detach(), policy + 0.04 * kl.view(-1))
    assert out.clipped.tolist() == [0.0, 1.0, 1.0, 0.0]
    out.policy_loss.sum().backward()
    # sample 1: ratio e^0.5 > 1.2 with A > 0 is clipped (no gradient); sample 2: ratio e^-0.5 < 0.8 with A < 0 too
    assert log_prob.grad[1] == 0 and log_prob.grad[2] == 0
    assert log_prob.grad[0] == -1.0 and log_prob.grad[3] != 0
    assert clipped_policy_loss(log_prob, old, adv, 0.2, 5.0).kl is None


def test_train_step_indices():
    assert train_step_indices(10, 0.5) == [0, 1, 2, 3, 4]
    assert train_step_indices(4, 0.1) == [0]
    with pytest.raises(ValueError, match="timestep_fraction"):
        train_step_indices(4, 0.0)


def test_flow_grpo_section_reads_rewards_and_refuses_bad_values():
    from pydantic import ValidationError

    from spindle.config import DiffusionDpoConfig, FlowGrpoConfig

    cfg = FlowGrpoConfig(rewards=["rewards.py:brightness", "builtin:jpeg_compressibility"], reward_weights=[1.0, 0.1])
    assert [(r.fn, r.builtin, r.weight) for r in cfg.reward_configs] == [
        ("rewards.py:brightness", None, 1.0),
        (None, "jpeg_compressibility", 0.1),
    ]
    assert (cfg.num_generations, cfg.noise_level, cfg.clip_range, cfg.adv_clip_max) == (8, 0.7, 1e-4, 5.0)
    with pytest.raises(ValidationError, match=r"num_generationz"):
        FlowGrpoConfig(rewards=["a.py:f"], num_generationz=4)
    with pytest.raises(ValidationError, match=r"flow_grpo.reward_weights has 1 entries for 2 rewards"):
        FlowGrpoConfig(rewards=["a.py:f", "b.py:g"], reward_weights=[1.0])
    with pytest.raises(ValidationError, match=r"flow_grpo.rewards\[0\] \(model: folder\) is a reward-model folder"):
        FlowGrpoConfig(rewards=["folder"])
    with pytest.raises(ValidationError, match=r"noise_level"):
        FlowGrpoConfig(rewards=["a.py:f"], noise_level=0)
    with pytest.raises(ValidationError, match=r"timestep_fraction"):
        FlowGrpoConfig(rewards=["a.py:f"], timestep_fraction=1.5)
    assert DiffusionDpoConfig().beta == 100.0
    with pytest.raises(ValidationError, match="beta"):
        DiffusionDpoConfig(beta=0)


def test_a_bf16_rollout_records_the_rounded_transition_it_continues_from():
    """Latents kept in bf16 between steps: the log-prob is taken of the rounded sample, so recomputing it from
    the stored bf16 latents gives the recorded value exactly."""
    scheduler = schedule()
    torch.manual_seed(4)
    x, v = torch.randn(2, 6, 8).bfloat16(), torch.randn(2, 6, 8)
    step = sde_step(v, x, scheduler.sigmas, 1, 0.7, generators=seeded(5, 2), latent_dtype=torch.bfloat16)
    stored = step.prev_sample.to(torch.bfloat16)
    assert torch.equal(stored.float(), step.prev_sample)
    again = sde_step(v, x, scheduler.sigmas, 1, 0.7, prev_sample=stored)
    assert logprob_mismatch(step.log_prob, again.log_prob) == 0.0
    unrounded = sde_step(v, x, scheduler.sigmas, 1, 0.7, generators=seeded(5, 2))
    assert not torch.equal(unrounded.prev_sample, step.prev_sample)


def test_the_parts_together_raise_a_reward():
    """Rollouts with the recorder, group advantages and the clipped loss, on a small denoiser whose reward is
    the final latents' mean ("brightness"): the signs and scales add up to a policy that improves. Each step's
    recomputed log-probs equal the recorded ones (nothing changed the weights in between)."""
    from spindle.train.objectives.flow_grpo import SdeRecorder, draw_noise

    model = Velocity()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def make(seed: int, step: int, key: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed * 100003 + step * 1009 + key)

    groups, prompts, noise_level = 4, 2, 0.7
    means = []
    for step in range(30):
        scheduler = schedule()
        generators = rollout_generators(make, 0, step, list(range(prompts)), groups)
        recorder = SdeRecorder(noise_level, generators)
        x = draw_noise((prompts * groups, 6, 8), generators)
        with torch.no_grad():
            for i, t in enumerate(scheduler.timesteps):
                x = recorder(scheduler, model(x, scheduler.sigmas[i].expand(len(x))), t, i, x)
        traj = recorder.trajectory()
        reward = x.mean(dim=(1, 2))
        means.append(float(reward.mean()))
        advantages = group_advantages(reward, groups)
        opt.zero_grad()
        for j in range(STEPS):
            velocity = model(traj.latents[:, j], scheduler.sigmas[j].expand(len(x)))
            step_out = traj.transition_log_prob(velocity, j, noise_level)
            assert logprob_mismatch(traj.log_probs[:, j], step_out.log_prob) <= 1e-5
            loss = clipped_policy_loss(step_out.log_prob, traj.log_probs[:, j], advantages, 0.2, 5.0).loss
            (loss.sum() / (len(x) * STEPS)).backward()
        opt.step()
    first, last = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert last > first + 0.05, (first, last)


def test_a_step_index_per_sample_is_each_samples_own_step():
    """Samples of one batch at different denoising steps (a trainer that shuffles steps per sample)."""
    scheduler = schedule()
    torch.manual_seed(5)
    x, v, nxt = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8)
    both = sde_step(v, x, scheduler.sigmas, torch.tensor([0, 2]), 0.7, prev_sample=nxt)
    for row, index in enumerate((0, 2)):
        alone = sde_step(
            v[row : row + 1], x[row : row + 1], scheduler.sigmas, index, 0.7, prev_sample=nxt[row : row + 1]
        )
        torch.testing.assert_close(both.log_prob[row : row + 1], alone.log_prob, rtol=0, atol=1e-6)
        torch.testing.assert_close(both.prev_sample_mean[row : row + 1], alone.prev_sample_mean, rtol=0, atol=1e-6)
    assert both.log_prob[0] != both.log_prob[1]
