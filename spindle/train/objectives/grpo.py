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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from spindle.contracts.task import Objective
from spindle.train.objectives.cycles import check_cycle_multiples

GRPOLossType = Literal["grpo", "dr_grpo", "dapo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")
ScaleRewards = Literal["group", "batch", "none"]
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: added to the standard deviation, so a group of equal rewards gives advantages 0
NOT_ROWS = ("advantages", "old_log_probs")  # a batch's tensors that are no model input


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
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> GRPOLoss:
    """The clipped objective of B completions: per-token log-probabilities [B, T] under the policy being trained,
    advantages [B], the completion-token mask [B, T] (module doc). `whole`: under sequence parallelism, where the
    [B, T] tensors are this rank's chunk of the rows, the sum over the SP ranks of a count (a row's completion
    tokens, the clipped tokens, the KL): the normalisers and metrics are then the whole rows' while `loss_sum` is
    this chunk's share (the shares sum to the whole loss, as a token loss's chunks do)."""
    whole = whole or (lambda value: value)
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
        kl_sum = whole((kl.detach() * mask).sum())
    tokens = whole(mask.sum())
    completions = torch.tensor(float(per_token.shape[0]), dtype=per_token.dtype, device=per_token.device)
    masked = per_token * mask
    if loss_type == "grpo":
        loss_sum = (masked.sum(-1) / whole(mask.sum(-1)).clamp(min=1.0)).sum()
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
        clipped_low=whole((low * mask).sum()),
        clipped_high=whole((high_clipped * mask).sum()),
    )


class GRPO(Objective):
    """`train.objective: grpo` (online; causal LMs, VLMs, omni models): the clipped objective above as a part of a
    task (`grpo:` settings). `train.global_batch_size` counts prompts.

    Each step, before its loss is counted (`begin_step`), every rank samples `num_generations` completions of each
    of its prompts from the live policy (`spindle.train.generation`: a KV cache, the ranks in lockstep, one
    generator per completion keyed on (seed, step, prompt, sample)), decodes them, scores them with `grpo.rewards`
    (`spindle.train.rewards`: functions with TRL's keyword convention, reward-model folders, HTTP scorers; extra
    prompt columns passed by name) and computes the group-relative advantages. Then `forward` runs prompt +
    completion through the policy for each completion token's log-probability and optimises the clipped objective
    (the old policy is the sampler; with `num_iterations` K the trainer trains each batch of completions for K
    optimizer steps, checkpointing only between such cycles), with beta x the KL to the reference when beta > 0 (a LoRA
    run: its adapters off; else a frozen copy of the starting weights). Tokens after a completion's end are
    masked. Metrics: reward_mean / reward_std, reward/NAME per reward, completion_length, clip ratios, kl,
    generated_tokens_per_s and the step's time split; every `train.log_every` steps rank 0 appends its prompts,
    completions and rewards to `<output_dir>/samples/grpo.jsonl`."""

    name = "grpo"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.settings = cfg.grpo
        self.rewards: Any = None
        self.reference: tuple[Any, torch.nn.Module] | None = None
        self.inputs: Any = None  # the task's PreferenceInputs (build_loader)

    def check_plan(self, family: Any, dims: Any) -> None:
        from spindle.config import ConfigError

        if family.kind not in ("causal_lm", "vlm", "omni"):
            raise ConfigError(
                f"train.objective=grpo: {family.name} is a {family.kind} model; GRPO trains language, "
                "vision-language and omni families (DiTs: train.objective=flow_grpo)"
            )
        check_cycle_multiples("grpo", self.settings.num_iterations, self.cfg)
        self.reward_set()  # every reward resolved (files imported, folders read) before any model loads

    def updates_per_batch(self) -> int:
        return int(self.settings.num_iterations)

    def reward_set(self) -> Any:
        if self.rewards is None:
            from spindle.train.rewards.load import load_rewards

            self.rewards = load_rewards(self.settings.reward_configs, "lm", "grpo")
        return self.rewards

    def prepare(self, task: Any, model: torch.nn.Module) -> None:
        self.reward_set()
        if self.settings.beta > 0 and self.cfg.train.lora is None:
            self.reference = task.build_reference(self.cfg.model.path)

    def build_loader(self, task: Any) -> Any:
        from spindle.data.preference import read_prompts
        from spindle.train.tasks.base import resumable_loader

        self.inputs = task.preference_inputs()  # text, or media in the prompts (vision-language / omni families)
        prompts = read_prompts(
            self.cfg.data.path,
            task.tokenizer,
            self.settings.max_prompt_length,
            self.inputs.tokenize_prompt,
            self.inputs.media_ids,
        )
        task._data_stats = {"rows": len(prompts), "prompts": len(prompts)}
        return resumable_loader(task, list(enumerate(prompts)), list)

    def begin_step(self, task: Any, model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        import time

        from spindle.distributed.ulysses_attention import sequence_parallel_paused
        from spindle.train.generation import Sampling, rollout_generator, sample_group

        s = self.settings
        tok = task.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = {tok.eos_token_id}
        config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos |= set(config_eos if isinstance(config_eos, list) else [config_eos] if config_eos is not None else [])
        sampling = Sampling(s.max_new_tokens, s.temperature, s.top_p)
        out = []
        was_training = model.training
        model.eval()  # the KV cache (activation checkpointing refuses it in training mode)
        rollout = self.inputs.rollout_inputs  # a VLM prompt's media and positions per step; None: text
        # under SP the ranks of an SP group hold the same prompts and sample the same completions whole (the keyed
        # generators), in lockstep for FSDP2's gathers; the update then splits each row over them
        try:
            with sequence_parallel_paused(model):
                for examples in batches:
                    start = time.perf_counter()
                    groups = []
                    for index, example in examples:
                        gens = [
                            rollout_generator(self.cfg.train.seed, step, index, j) for j in range(s.num_generations)
                        ]
                        inputs = rollout(example, s.num_generations) if rollout is not None else None
                        groups.append(
                            sample_group(model, example.prompt_ids, gens, sampling, eos, pad, task.device, inputs)
                        )
                    generated = time.perf_counter() - start
                    out.append(self._score(task, examples, groups, pad, generated))
        finally:
            model.train(was_training)
        if step % self.cfg.train.log_every == 0:
            self._write_samples(task, out, step)
        return out

    def _scored_once(self, task: Any, completions: list[Any], prompts: list[Any], columns: dict[str, Any]) -> Any:
        """The rewards of a batch's completions. Under Ulysses SP the ranks of an SP group hold the same prompts and
        completions: its first rank scores them and the group receives its scores, so a reward function, a reward-
        model folder or an HTTP scorer sees each completion once (not sp times; a stateful or paid scorer counts
        right). What the scoring raised is raised on every rank of the group, so none waits on a peer that
        stopped."""
        if task.mesh.dims.sp == 1:
            return self.reward_set()(completions, prompts, columns)
        import torch.distributed as dist

        group = task.mesh.sp.get_group()
        box: list[Any] = [None]
        if task.mesh.sp_rank == 0:
            try:
                box[0] = (True, self.reward_set()(completions, prompts, columns))
            except Exception as e:  # noqa: BLE001 -- handed to the peers, then raised here as on every rank
                box[0] = (False, e)
        dist.broadcast_object_list(box, group=group, group_src=0)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _score(self, task: Any, examples: list[Any], groups: list[Any], pad: int, generated_s: float) -> dict[str, Any]:
        import time

        s, tok, g = self.settings, task.tokenizer, self.settings.num_generations
        start = time.perf_counter()
        prompts: list[Any] = []
        completions: list[Any] = []
        columns: dict[str, list[Any]] = {}
        rows: list[tuple[list[int], list[int], list[Any]]] = []
        for (_, example), (tokens, mask) in zip(examples, groups, strict=True):
            conversational = isinstance(example.prompt, list)
            for j in range(g):
                ids = tokens[j][mask[j].bool()].tolist()
                text = tok.decode(ids, skip_special_tokens=True)
                completions.append([{"role": "assistant", "content": text}] if conversational else text)
                prompts.append(example.prompt)
                rows.append((example.prompt_ids, ids, example.media))
                for key, value in example.columns.items():
                    columns.setdefault(key, []).append(value)
        scores = self._scored_once(task, completions, prompts, columns)
        per_function = torch.stack([scores.per_reward[n] for n in self.rewards.names], dim=1)
        weights = torch.tensor([r.weight for r in self.rewards.rewards], dtype=torch.float32)
        adv = group_advantages(per_function, g, weights, s.scale_rewards)
        scored = time.perf_counter() - start
        batch = self.inputs.collate_rows(rows, pad_id=pad, multiple=task.mesh.dims.sp)  # SP: equal chunks
        lengths = torch.tensor([len(c) for _, c, _ in rows], dtype=torch.float32)
        rewards = adv.rewards
        metrics = {
            "reward_mean": float(torch.nanmean(rewards)),
            "reward_std": float(nan_std(rewards)) if rewards.numel() > 1 else 0.0,
            **scores.means(),
            "completion_length": float(lengths.mean()),
            "generated_tokens_per_s": float(lengths.sum()) / max(generated_s, 1e-9),
            "time/generation_s": generated_s,
            "time/scoring_s": scored,
        }
        return {
            **{k: v for k, v in batch.items() if k not in ("attention_mask", "completion_mask")},
            "advantages": adv.advantages.float(),
            "metrics": metrics,
            "samples": [
                {"prompt": p, "completion": c, "reward": float(r)}
                for p, c, r in zip(prompts, completions, scores.total.tolist(), strict=True)
            ],
        }

    def _write_samples(self, task: Any, batches: list[dict[str, Any]], step: int) -> None:
        import json
        from pathlib import Path

        from spindle.distributed.mesh import is_main_process

        if not is_main_process():
            return
        folder = Path(self.cfg.train.output_dir) / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "grpo.jsonl", "a") as f:
            for batch in batches:
                for sample in batch["samples"]:
                    f.write(json.dumps({"step": step + 1, **sample}, default=str) + "\n")

    def loss_units(self, batch: dict[str, Any]) -> int:
        if self.settings.loss_type == "dapo":
            return int((batch["shift_labels"] != -100).sum())  # completion tokens
        return int(batch["input_ids"].shape[0])  # completions

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, Any], step: int) -> Any:
        import time

        from spindle.contracts.task import Metric, StepOutput
        from spindle.train.objectives.logprobs import reference_log_probs, sequence_parallel_sum

        s = self.settings
        start = time.perf_counter()
        rows = {k: v for k, v in batch.items() if torch.is_tensor(v) and k not in NOT_ROWS}  # tokens and media
        run = task.run_rows(model, rows, log_probs=True, temperature=s.temperature)
        mask = (run.rows["shift_labels"] != -100).to(run.log_probs.dtype)
        # The old policy is the sampler. The cycle's first update runs on the sampler's weights, so its own
        # log-probabilities (detached) are the old ones; kept on the batch, the cycle's later updates reuse them
        # (TRL's old_per_token_logps, without its extra forward)
        old = batch.get("old_log_probs")
        rollout_metrics = batch["metrics"]
        if old is None and s.num_iterations > 1:
            batch["old_log_probs"] = run.log_probs.detach()
            batch["metrics"] = reused_metrics(rollout_metrics)  # the times are logged on the cycle's first step
        ref = None
        if s.beta > 0:
            with torch.no_grad():
                ref = reference_log_probs(task, model, rows, self.reference, temperature=s.temperature)
        out = grpo_loss(
            run.log_probs,
            batch["advantages"].to(run.log_probs.device),
            mask,
            old,
            ref,
            epsilon=s.epsilon,
            epsilon_high=s.epsilon_high,
            beta=s.beta,
            loss_type=s.loss_type,
            max_completion_length=s.max_new_tokens,
            whole=lambda value: sequence_parallel_sum(value.detach(), task),
        )
        metrics: dict[str, Any] = {k: Metric(v, "mean", "mean") for k, v in rollout_metrics.items()}
        metrics.update({k: Metric(v, "mean", "mean") for k, v in out.metrics().items()})
        metrics["time/update_forward_s"] = Metric(time.perf_counter() - start, "sum", "mean")
        return StepOutput(out.loss_sum.float(), int(rows["input_ids"].shape[0]), run.tokens, metrics)


def reused_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A batch's rollout metrics for the later steps of its `num_iterations` cycle: no generation or scoring ran
    (their times 0, no tokens/s); the rewards are the cycle's (as the rollout's samples are)."""
    return {**metrics, "time/generation_s": 0.0, "time/scoring_s": 0.0, "generated_tokens_per_s": 0.0}
