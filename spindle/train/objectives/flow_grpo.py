"""Flow-GRPO's math for flow-matching denoisers (Liu et al. 2025, github.com/yifan123/flow_grpo), as pure
functions: the SDE sampler step with its log-probability, group-relative advantages, and the clipped policy
objective with its optional KL to the reference.

The SDE step turns the deterministic Euler step of a flow-matching scheduler into a Gaussian transition
with the same marginals, so a rollout has a log-probability per denoising step:

    std_dev_t = noise_level * sqrt(sigma / (1 - sigma))        (sigma == 1: sigma_max = sigmas[1] instead)
    mean      = x * (1 + std_dev_t^2 / (2 sigma) * dt) + v * (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) * dt
    x_next    = mean + std_dev_t * sqrt(-dt) * eps,        dt = sigma_next - sigma < 0

and the step's log-prob is the Gaussian log-density of `x_next` averaged over every element but the batch
dimension (Flow-GRPO's definition; the `logprob_mismatch` metric compares these). With `noise_level == 0`
the step is the scheduler's Euler step `x + dt * v`, which is what validation samples use.

Every random draw comes from the generator of its sample, so a rollout depends on (seed, step, prompt,
sample) only — not on the rank, the micro-batch or the batch size it was generated in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Flow-GRPO adds this to the group's standard deviation, so a group whose rewards are all equal gets
# advantages of 0 rather than 0 / 0.
ADVANTAGE_STD_EPS = 1e-4


@dataclass(frozen=True)
class SdeStep:
    """One denoising step of the SDE sampler, per sample of the batch.

    `prev_sample`: the next (less noisy) latents, float32; `log_prob`: [B], the transition's log-density
    averaged over the latent elements (None for the deterministic step, which has no density);
    `prev_sample_mean`: the Gaussian's mean; `std_dev_t`: its noise scale before the sqrt(-dt) factor,
    shaped to broadcast against the latents ([B, 1, ...]).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor | None
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor


def step_sigmas(sigmas: torch.Tensor, step_index: int | torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigma, sigma_next) of a step, one per sample ([B]): `sigmas` is the scheduler's schedule after
    `set_timesteps` (`scheduler.sigmas`: the inference steps' sigmas plus the final 0); `step_index` is
    the step's position in it, one for the batch or one per sample."""
    index = torch.as_tensor(step_index, dtype=torch.long, device=sigmas.device).reshape(-1)
    if index.numel() == 1:
        index = index.expand(batch)
    if index.numel() != batch:
        raise ValueError(f"step_index has {index.numel()} entries for a batch of {batch}; give one, or one per sample")
    if int(index.min()) < 0 or int(index.max()) >= len(sigmas) - 1:
        raise ValueError(
            f"step_index {index.tolist()} is outside the schedule's {len(sigmas) - 1} steps "
            "(sigmas must be the scheduler's `sigmas`, the final 0 included)"
        )
    return sigmas[index].float(), sigmas[index + 1].float()


def sde_std(sigma: torch.Tensor, sigma_max: float, noise_level: float) -> torch.Tensor:
    """Flow-GRPO's noise scale std_dev_t = noise_level * sqrt(sigma / (1 - sigma)); at sigma == 1, where
    that diverges, the schedule's second sigma (`sigma_max`) stands in, as the reference does."""
    return torch.sqrt(sigma / (1 - torch.where(sigma == 1, torch.full_like(sigma, sigma_max), sigma))) * noise_level


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """log N(x; mean, std^2) per element, averaged over every dimension but the batch one ([B])."""
    log_prob = -((x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def sde_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int | torch.Tensor,
    noise_level: float,
    generators: Sequence[torch.Generator] | None = None,
    prev_sample: torch.Tensor | None = None,
    latent_dtype: torch.dtype | None = None,
) -> SdeStep:
    """One step of Flow-GRPO's SDE sampler from `sample` (the latents at `sigmas[step_index]`) given the
    velocity `model_output` (after CFG).

    Rollout: leave `prev_sample` None and give `generators`, one per sample: the step's noise is drawn
    from them (on CPU, then moved), so each sample's draw is its own. Training: give the recorded
    `prev_sample` to get its log-prob under the current model (no draw). `noise_level == 0` is the
    deterministic Euler step (no log-prob). Everything is computed in float32, since bf16 overflows in
    the mean's terms. `latent_dtype`: the dtype the rollout keeps its latents in (bf16 inference); the
    drawn sample is rounded to it before its log-prob is taken, so the recorded transition is exactly the
    one the next step and the trainer's recomputation see (the returned `prev_sample` stays float32).
    """
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0; got {noise_level}")
    model_output = model_output.float()
    sample = sample.float()
    batch = sample.shape[0]
    sigma, sigma_next = step_sigmas(sigmas, step_index, batch)
    shape = (batch, *([1] * (sample.ndim - 1)))
    sigma = sigma.to(sample.device).view(shape)
    sigma_next = sigma_next.to(sample.device).view(shape)
    sigma_max = float(sigmas[1]) if len(sigmas) > 1 else 0.0
    dt = sigma_next - sigma
    std_dev_t = sde_std(sigma, sigma_max, noise_level)
    if noise_level == 0:
        # exactly the scheduler's Euler step (FlowMatchEulerDiscreteScheduler.step: sample + dt * model_output)
        mean = sample + dt * model_output
        return SdeStep(mean if prev_sample is None else prev_sample.float(), None, mean, std_dev_t)
    mean = (
        sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    scale = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        if generators is None or len(generators) != batch:
            got = "none" if generators is None else len(generators)
            raise ValueError(f"a rollout step needs one generator per sample: {batch} samples, {got} generators")
        noise = draw_noise(tuple(sample.shape), generators).to(sample.device)
        prev_sample = mean + scale * noise
        if latent_dtype is not None:
            prev_sample = prev_sample.to(latent_dtype).float()
    else:
        prev_sample = prev_sample.float()
    return SdeStep(prev_sample, gaussian_log_prob(prev_sample, mean, scale), mean, std_dev_t)


class SdeRecorder:
    """The step a rollout puts in place of `scheduler.step` in a denoising loop (the engine's DenoisingStage:
    `latents = recorder(req.scheduler, noise_pred, t, i, latents)`): it takes the SDE step with the samples'
    generators and records the trajectory for training.

    The schedule is the scheduler's (`scheduler.sigmas` after `set_timesteps`, starting at its
    `begin_index`); the latents keep the loop's dtype (the draw is rounded to it before its log-prob).
    """

    def __init__(self, noise_level: float, generators: Sequence[torch.Generator]) -> None:
        if noise_level <= 0:
            raise ValueError(f"a rollout's noise_level must be > 0 (0 has no log-prob); got {noise_level}")
        self.noise_level = noise_level
        self.generators = list(generators)
        self.latents: list[torch.Tensor] = []  # each step's input latents, then the final ones
        self.log_probs: list[torch.Tensor] = []
        self.step_indices: list[int] = []
        self.sigmas: torch.Tensor | None = None

    def __call__(
        self, scheduler: Any, model_output: torch.Tensor, t: torch.Tensor, i: int, latents: torch.Tensor
    ) -> torch.Tensor:
        if self.sigmas is None:
            self.sigmas = scheduler.sigmas.detach().float().cpu()
        index = i + int(getattr(scheduler, "begin_index", None) or 0)
        sigmas = scheduler.sigmas
        step = sde_step(
            model_output, latents, sigmas, index, self.noise_level, self.generators, latent_dtype=latents.dtype
        )
        if not self.latents:
            self.latents.append(latents.detach())
        elif not torch.equal(latents, self.latents[-1]):
            # the recorded transition j -> j + 1 must be the one step j + 1 starts from
            raise RuntimeError(
                f"denoising step {i} starts from other latents than step {i - 1} returned: the loop changed them "
                "between steps, so the rollout's transitions cannot be recomputed"
            )
        nxt = step.prev_sample.to(latents.dtype)
        self.latents.append(nxt.detach())
        assert step.log_prob is not None  # noise_level > 0
        self.log_probs.append(step.log_prob.detach())
        self.step_indices.append(index)
        return nxt

    def trajectory(self) -> Trajectory:
        if self.sigmas is None:
            raise RuntimeError("the recorder took no step")
        return Trajectory(
            latents=torch.stack(self.latents, dim=1),
            log_probs=torch.stack(self.log_probs, dim=1),
            step_indices=list(self.step_indices),
            sigmas=self.sigmas,
        )


@dataclass(frozen=True)
class Trajectory:
    """A batch of rollouts: `latents` [B, T + 1, ...] (step j's input at j, its output at j + 1, in the loop's
    dtype), `log_probs` [B, T] (float32), the schedule positions of the T steps, and the schedule."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    step_indices: list[int]
    sigmas: torch.Tensor

    def transition_log_prob(self, model_output: torch.Tensor, j: int, noise_level: float) -> SdeStep:
        """Step j's recorded transition under a (re)computed velocity: what the trainer differentiates, and
        what `logprob_mismatch` compares with `log_probs[:, j]` before the first update."""
        return sde_step(
            model_output,
            self.latents[:, j],
            self.sigmas.to(model_output.device),
            self.step_indices[j],
            noise_level,
            prev_sample=self.latents[:, j + 1],
        )


def draw_noise(shape: tuple[int, ...], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Standard normal noise of `shape`, row b drawn from `generators[b]` on CPU (float32)."""
    from diffusers.utils.torch_utils import randn_tensor

    noise: torch.Tensor = randn_tensor(shape, generator=list(generators), dtype=torch.float32)
    return noise


def rollout_generators(
    make: Callable[[int, int, int], torch.Generator],
    seed: int,
    step: int,
    prompt_indices: Sequence[int],
    num_generations: int,
) -> list[torch.Generator]:
    """One generator per rollout sample, prompt-major ([p0 s0, p0 s1, ..., p1 s0, ...]), from `make(seed,
    step, key)` (the trainer's per-sample generator, keyed on (seed, step, index)) with key
    `prompt_index * num_generations + sample`: a sample's initial noise and every SDE draw come from its
    own generator, whichever rank or micro-batch generates it."""
    return [make(seed, step, int(p) * num_generations + s) for p in prompt_indices for s in range(num_generations)]


def train_step_indices(num_inference_steps: int, timestep_fraction: float) -> list[int]:
    """The denoising steps the policy loss covers: the first `int(num_inference_steps * timestep_fraction)`
    (at least one), as Flow-GRPO trains them."""
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1]; got {timestep_fraction}")
    return list(range(max(1, int(num_inference_steps * timestep_fraction))))


def group_advantages(
    rewards: torch.Tensor, num_generations: int, global_std: bool = False, eps: float = ADVANTAGE_STD_EPS
) -> torch.Tensor:
    """Group-relative advantages: each reward minus its prompt group's mean, over the group's (or with
    `global_std`, the whole batch's) population standard deviation + eps. `rewards` is prompt-major
    ([num_prompts * num_generations]), the order `rollout_generators` gives."""
    if rewards.ndim != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be a flat, prompt-major vector of num_prompts x {num_generations}; got shape "
            f"{tuple(rewards.shape)}"
        )
    groups = rewards.double().view(-1, num_generations)
    mean = groups.mean(dim=1, keepdim=True)
    std = rewards.double().std(unbiased=False) if global_std else groups.std(dim=1, unbiased=False, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1).to(rewards.dtype)


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped objective of one denoising step, per sample ([B]); sum `loss` over samples and steps and
    divide by their count for Flow-GRPO's mean. `kl` is None when beta is 0."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor | None
    ratio: torch.Tensor
    clipped: torch.Tensor  # 1.0 where |ratio - 1| > clip_range (the clip fraction's numerator)
    approx_kl: torch.Tensor  # 0.5 * (log_prob - old_log_prob)^2, Flow-GRPO's logged estimate


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
    beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std_dev_t: torch.Tensor | None = None,
) -> PolicyLoss:
    """PPO's clipped objective as Flow-GRPO computes it, per sample: advantages clamped to
    [-adv_clip_max, adv_clip_max], ratio = exp(log_prob - old_log_prob), loss = max(-A * ratio,
    -A * clamp(ratio, 1 - clip_range, 1 + clip_range)). With `beta > 0`, + beta * KL where KL is the
    squared distance of the policy's and the reference's step means, averaged over elements, over
    2 * std_dev_t^2 (`mean`, `ref_mean`, `std_dev_t` from `sde_step` of the policy and the reference on
    the same transition)."""
    advantages = torch.clamp(advantages.to(log_prob), -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped)
    kl = None
    loss = policy_loss
    if beta > 0:
        if mean is None or ref_mean is None or std_dev_t is None:
            raise ValueError("beta > 0 needs the policy's and the reference's step means and std_dev_t")
        squared = ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim)))
        kl = squared / (2 * std_dev_t.reshape(-1) ** 2)
        loss = policy_loss + beta * kl
    return PolicyLoss(
        loss=loss,
        policy_loss=policy_loss,
        kl=kl,
        ratio=ratio.detach(),
        clipped=(torch.abs(ratio.detach() - 1.0) > clip_range).float(),
        approx_kl=0.5 * (log_prob.detach() - old_log_prob) ** 2,
    )


def logprob_mismatch(recorded: torch.Tensor, recomputed: torch.Tensor) -> float:
    """The largest absolute difference between a rollout's recorded log-probs and the trainer's
    recomputation of the same transitions before the first update (train/inference consistency: 0 up to
    float error when the rollout and the trainer run the same denoiser on the same weights)."""
    if recorded.shape != recomputed.shape:
        raise ValueError(f"recorded log-probs {tuple(recorded.shape)} and recomputed {tuple(recomputed.shape)} differ")
    return float((recorded.detach().double() - recomputed.detach().double()).abs().max()) if recorded.numel() else 0.0
