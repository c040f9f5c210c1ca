"""`train.objective: flow_grpo`: Flow-GRPO for flow-matching denoisers (Liu et al. 2025,
github.com/yifan123/flow_grpo). Its math as pure functions (the SDE sampler step with its log-probability,
group-relative advantages, the clipped policy objective with its optional KL to the reference) and the
`FlowGRPO` part of the flow-matching task that runs them (rollouts: `spindle.train.rollouts`).

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

from spindle.contracts.task import Objective, StepOutput
from spindle.train.objectives.cycles import check_cycle_multiples

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


class FlowGRPO(Objective):
    """`train.objective: flow_grpo` for every DiT family (DanceGRPO on video ones): the functions above as a part
    of the flow-matching task (`flow_grpo:` settings). `train.global_batch_size` counts prompts.

    Each step, before its loss is counted (`begin_step`), every rank generates `num_generations` samples of each
    of its prompts with Spindle's own engine on the live transformer (`spindle.train.rollouts`: the SDE sampler in
    the engine's denoising loop, every draw from a generator keyed on (seed, step, prompt, sample), so any layout
    or resume rolls out what one process does), decodes and scores them (`flow_grpo.rewards`), and computes the
    group-relative advantages (with `global_std`, over the whole global batch). The update is one micro-batch per
    rollout and trained denoising step (`timestep_fraction`): the stage's `predict` recomputes the step's velocity
    with gradients on the recorded latents and the same conditions, and the clipped objective (with beta x the KL
    to the reference when beta > 0: a LoRA run's adapters off, else a frozen copy of the starting weights) is
    averaged over samples and trained steps. The loss unit is the sample of one trained step. With
    `num_iterations` K, the trainer trains each batch of rollouts for K optimizer steps (`updates_per_batch`),
    checkpointing only between such cycles.

    Metrics: `logprob_mismatch` (the largest |recorded - recomputed| log-prob of the step, over every rank, before
    the update: train/inference consistency), reward_mean / reward_std and reward/NAME over the global batch,
    clip_fraction, approx_kl, kl (beta > 0), and the time split time/rollout_s (denoising), time/reward_s (decoding
    and rewards), time/update_s (this rank's). Every `train.log_every` steps rank 0 appends each sample's prompt and
    rewards to `<output_dir>/samples/flow_grpo.jsonl`."""

    name = "flow_grpo"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.settings = cfg.flow_grpo
        self.rewards: Any = None
        self.reference: torch.nn.Module | None = None  # None: a LoRA run's policy with its adapters off
        self._generator: Any = None  # the engine around the live transformer, built at the first rollout
        self._reference_stage: Any = None
        self._stats: dict[str, float] = {}
        self._mismatch: torch.Tensor | None = None
        self._rollout_step = -1  # the step whose begin_step rolled out the batches being trained
        self._update_start = 0.0

    # ------------------------------------------------------------ before launch

    def check_plan(self, family: Any, dims: Any) -> None:
        from spindle.config import ConfigError

        data = self.cfg.data
        refused = {
            "data.precomputed": "rollouts encode their prompts as the engine does; remove data.precomputed",
            "data.buckets": "rollouts are generated at data.resolution (x data.num_frames); set data.buckets: false",
            "data.sources": "give the prompts as one JSONL file in data.path",
            "data.control_dir": 'give each prompt its conditioning image as "image" in the prompts file',
        }
        for key, fix in refused.items():
            if getattr(data, key.split(".")[1]):
                raise ConfigError(f"train.objective=flow_grpo does not take {key}: {fix}")
        if family.inference is None:
            raise ConfigError(f"train.objective=flow_grpo: {family.name} has no inference pipeline to roll out with")
        check_cycle_multiples("flow_grpo", self.settings.num_iterations, self.cfg)
        prompts = self.prompts(family)  # every line and conditioning image checked before any model loads
        self.check_options(family, prompts[0])
        self.reward_set()  # every reward resolved (files imported, folders read)

    def check_options(self, family: Any, prompt: Any) -> None:
        """`flow_grpo.options`: the family's sampling options (names, types, bounds), checked as a request of the
        first prompt would be."""
        from spindle.config import ConfigError
        from spindle.contracts.request import RequestError, SamplingParams
        from spindle.contracts.sampling import sampling_schema

        if not self.settings.options:
            return
        try:
            fields, extra = split_options(self.settings.options)
            images = [str(p) for p in prompt.images] or None
            sampling_schema(family.options, family.name).validate(
                SamplingParams(prompt=prompt.prompt, image=images, **fields, extra=extra)
            )
        except (RequestError, ValueError, TypeError) as e:
            raise ConfigError(f"flow_grpo.options: {e}") from None

    def updates_per_batch(self) -> int:
        return int(self.settings.num_iterations)

    def check_data(self) -> None:
        """None here: the prompts file is checked by `check_plan`, which knows how many conditioning images the
        family's requests take."""
        return None

    def prompts(self, family: Any) -> list[Any]:
        from spindle.data.media_prompts import read_media_prompts

        images = family.condition_model_cls().request_images(self.cfg.model.path) or family.options.images
        return read_media_prompts(self.cfg.data.path, images, family.name)

    def reward_set(self) -> Any:
        if self.rewards is None:
            from spindle.train.rewards.load import load_rewards

            self.rewards = load_rewards(self.settings.reward_configs, "dit", "flow_grpo")
        return self.rewards

    # ------------------------------------------------------------ set-up

    def prepare(self, task: Any, model: torch.nn.Module) -> None:
        self.reward_set()
        if self.settings.beta > 0 and self.cfg.train.lora is None:
            self.reference = task.build_reference()

    def build_loader(self, task: Any) -> Any:
        from spindle.train.tasks.base import resumable_loader

        prompts = self.prompts(task.family)
        task._data_stats = {"rows": len(prompts), "prompts": len(prompts)}
        return resumable_loader(task, list(enumerate(prompts)), list)

    def _engine(self, task: Any, model: torch.nn.Module) -> Any:
        """The engine around the live transformer (built once). Not `exact`, so CFG runs batched, but without the
        CPU feed-forward fusion, which would compute the rollout's velocities another way than the update's."""
        if self._generator is None:
            from spindle.infer.stages import DenoisingStage
            from spindle.train.live_engine import live_generator

            self._generator = live_generator(task, model, fast_mlp=False)
            if self.reference is not None:
                stage = self._generator.pipeline.denoising
                self._reference_stage = DenoisingStage(self.reference, stage.spec, cfg_batch=stage.cfg_batch)
        return self._generator

    def _params(self, task: Any, prompt: Any, generator: Any) -> Any:
        from spindle.contracts.request import SamplingParams

        cfg, s = self.cfg, self.settings
        height, width = (int(v) for v in cfg.data.resolution)
        fields, extra = split_options(s.options)
        params = SamplingParams(
            **fields,
            extra=extra,
            prompt=prompt.prompt,
            height=height,
            width=width,
            num_inference_steps=s.num_inference_steps,
            guidance_scale=s.guidance_scale,
            seed=cfg.train.seed,  # the noise comes from the keyed generators; a seed keeps the engine from drawing one
            num_outputs_per_prompt=s.num_generations,
            image=[str(p) for p in prompt.images] or None,
        )
        if generator.defaults.max_sequence_length is not None:  # the prompts padded as training encodes them
            params.max_sequence_length = cfg.model.max_text_length
        if generator.pipeline.spec.media == "video":
            params.num_frames = cfg.data.num_frames
        return params

    # ------------------------------------------------------------ step

    def begin_step(self, task: Any, model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        import time

        from spindle.train.rollouts import rollout
        from spindle.train.tasks.flow_matching import sample_generator

        s, g = self.settings, self.settings.num_generations
        generator = self._engine(task, model)
        rollouts = []
        was_training = model.training
        model.eval()
        try:
            with task._autocast():
                for examples in batches:
                    for index, prompt in examples:
                        gens = rollout_generators(sample_generator, self.cfg.train.seed, step, [index], g)
                        params = self._params(task, prompt, generator)
                        rollouts.append((prompt, rollout(generator, params, SdeRecorder(s.noise_level, gens))))
        finally:
            model.train(was_training)
        start = time.perf_counter()
        scores = self._score(rollouts)
        advantages = self._advantages(task, scores)
        denoise = sum(r.timings["denoise_s"] for _, r in rollouts)
        decode = sum(r.timings["decode_s"] for _, r in rollouts)
        self._stats.update({"time/rollout_s": denoise, "time/reward_s": decode + time.perf_counter() - start})
        if step % self.cfg.train.log_every == 0:
            self._write_samples(rollouts, scores, step)
        out = []
        for n, (_, r) in enumerate(rollouts):
            steps = self._trained_steps(task, r.req)
            out += [
                {"rollout": r, "j": j, "advantages": advantages[n * g : (n + 1) * g], "first": j == steps[0]}
                for j in steps
            ]
        self._mismatch = None
        self._rollout_step = step
        self._update_start = time.perf_counter()
        return out

    def _trained_steps(self, task: Any, req: Any) -> list[int]:
        """The rollout steps the loss covers: the first `timestep_fraction` of them, and of a two-expert checkpoint
        (Wan2.2 A14B) only those the trained expert denoises (the other one is frozen in the rollouts)."""
        from spindle.config import ConfigError
        from spindle.train.live_engine import trained_component

        s = self.settings
        steps = train_step_indices(s.num_inference_steps, s.timestep_fraction)
        spec = self._generator.pipeline.spec
        if not spec.expert_components:
            return steps
        trained = trained_component(task, spec)
        own = [j for j in steps if spec.step_denoiser(req, req.timesteps[j])[0] == trained]
        if not own:
            raise ConfigError(
                f"flow_grpo: none of the trained rollout steps {steps} is denoised by the trained expert "
                f"({self.cfg.train.expert}, {trained}); raise flow_grpo.timestep_fraction or num_inference_steps, or "
                "train the other expert"
            )
        return own

    def _score(self, rollouts: list[Any]) -> Any:
        """This rank's samples scored in one call of the reward set (an HTTP scorer gets one batch)."""
        g = self.settings.num_generations
        images = [image for _, r in rollouts for image in r.images]
        prompts = [p.prompt for p, _ in rollouts for _ in range(g)]
        keys = sorted({k for p, _ in rollouts for k in p.columns})
        columns = {k: [p.columns.get(k) for p, _ in rollouts for _ in range(g)] for k in keys}
        return self.reward_set()(images, prompts, columns)

    def _advantages(self, task: Any, scores: Any) -> torch.Tensor:
        """Group-relative advantages of this rank's samples, and the global batch's reward metrics: the rewards of
        every data-parallel rank are gathered (the same count on each), so `global_std` and the logged means see
        the global batch whatever the layout."""
        import torch.distributed as dist

        names = self.reward_set().names
        local = torch.stack([scores.total, *(scores.per_reward[n] for n in names)], dim=1)
        gathered, rank = local, 0
        if dist.is_initialized() and task.mesh.dims.dp_size > 1:
            group = task.mesh.dp.get_group()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            gathered, rank = torch.cat(parts), dist.get_rank(group)
        total = gathered[:, 0]
        advantages = group_advantages(total, self.settings.num_generations, self.settings.global_std)
        self._stats = {
            "reward_mean": float(total.mean()),
            "reward_std": float(total.std(unbiased=False)),
            **{f"reward/{n}": float(gathered[:, k + 1].mean()) for k, n in enumerate(names)},
        }
        count = local.shape[0]
        return advantages[rank * count : (rank + 1) * count].float()

    def _write_samples(self, rollouts: list[Any], scores: Any, step: int) -> None:
        """`step`: the trainer's count of finished steps (the lines say the step as metrics.jsonl numbers it)."""
        import json
        from pathlib import Path

        from spindle.distributed.mesh import is_main_process

        if not is_main_process():
            return
        folder = Path(self.cfg.train.output_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        g, n = self.settings.num_generations, 0
        with open(folder / "flow_grpo.jsonl", "a") as f:
            for prompt, _ in rollouts:
                for sample in range(g):
                    rewards = {name: float(v[n]) for name, v in scores.per_reward.items()}
                    line = {
                        "step": step + 1,
                        "prompt": prompt.prompt,
                        "sample": sample,
                        "reward": float(scores.total[n]),
                    }
                    f.write(json.dumps({**line, "rewards": rewards}) + "\n")
                    n += 1

    def loss_units(self, batch: dict[str, Any]) -> int:
        return int(batch["advantages"].numel())  # the rollout's samples, at one trained step

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, Any], step: int) -> StepOutput:
        from spindle.contracts.task import Metric

        s = self.settings
        rollout, j = batch["rollout"], batch["j"]
        req, trajectory = rollout.req, rollout.trajectory
        stage = self._generator.pipeline.denoising
        latents, t = trajectory.latents[:, j].to(task.device), req.timesteps[j]
        with task._autocast():
            velocity = stage.predict(req, latents, t, j)
        policy = trajectory.transition_log_prob(velocity, j, s.noise_level)
        assert policy.log_prob is not None  # noise_level > 0 (the config requires it)
        ref_mean = None
        if s.beta > 0:
            with torch.no_grad(), task._autocast():
                if self.reference is None:
                    from spindle.train.lora import adapters_disabled

                    with adapters_disabled(model):
                        ref_velocity = stage.predict(req, latents, t, j)
                else:
                    ref_velocity = self._reference_stage.predict(req, latents, t, j)
            ref_mean = trajectory.transition_log_prob(ref_velocity, j, s.noise_level).prev_sample_mean
        recorded = trajectory.log_probs[:, j].to(policy.log_prob.device)
        out = clipped_policy_loss(
            policy.log_prob,
            recorded,
            batch["advantages"].to(policy.log_prob.device),
            s.clip_range,
            s.adv_clip_max,
            s.beta,
            policy.prev_sample_mean,
            ref_mean,
            policy.std_dev_t,
        )
        if step == self._rollout_step:  # before the first update: the recomputation must equal the rollout
            difference = (recorded.double() - policy.log_prob.detach().double()).abs().max()
            self._mismatch = difference if self._mismatch is None else torch.maximum(self._mismatch, difference)
        metrics: dict[str, Any] = {
            "clip_fraction": Metric(out.clipped.mean(), "mean", "mean"),
            "approx_kl": Metric(out.approx_kl.mean(), "mean", "mean"),
        }
        if out.kl is not None:
            metrics["kl"] = Metric(out.kl.detach().mean(), "mean", "mean")
        samples = int(latents.shape[0]) if batch["first"] else 0  # throughput counts each sample once per step
        tokens = samples * (stage.spec.sequence_length(req, stage.transformer) or 0)
        return StepOutput(out.loss.sum(), samples, tokens, metrics)

    def step_metrics(self, task: Any) -> dict[str, Any]:
        """Collective, after the update: the step's largest log-prob mismatch over every rank, the global reward
        metrics and the time split."""
        import time

        import torch.distributed as dist

        mismatch = torch.zeros((), dtype=torch.float64) if self._mismatch is None else self._mismatch.detach().cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            mismatch = mismatch.to(task.device)
            dist.all_reduce(mismatch, op=dist.ReduceOp.MAX)
        out = {
            "logprob_mismatch": float(mismatch),
            **self._stats,
            "time/update_s": time.perf_counter() - self._update_start,
        }
        # the next steps of a num_iterations cycle reuse these rollouts: no rollout time, and the recorded
        # log-probs are no longer the weights' (their ratios leave 1), so no mismatch to measure
        self._stats.update({"time/rollout_s": 0.0, "time/reward_s": 0.0})
        self._mismatch = None
        self._update_start = time.perf_counter()
        return out


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """`flow_grpo.options` -> (the request fields it sets, e.g. negative_prompt; the family's extra options).
    The fields the rollouts own (prompt, sizes, steps, seed, samples, images) are refused."""
    import dataclasses

    from spindle.contracts.request import SamplingParams

    owned = {"prompt", "height", "width", "num_frames", "num_inference_steps", "seed", "num_outputs_per_prompt"}
    owned |= {"image", "max_sequence_length", "guidance_scale", "lora", "lora_scale", "extra"}
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    taken = sorted(owned & set(options))
    if taken:
        raise ValueError(
            f"flow_grpo.options may not set {taken[0]!r}: the rollouts set it (guidance_scale and "
            "num_inference_steps are flow_grpo keys; sizes come from data.resolution / data.num_frames)"
        )
    return {k: v for k, v in options.items() if k in known}, {k: v for k, v in options.items() if k not in known}
