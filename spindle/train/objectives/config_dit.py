"""The DiT post-training sections: `flow_grpo:` (online RL from rewards with the SDE sampler) and
`diffusion_dpo:` (offline preference pairs), chosen by `train.objective` (see docs/post-training-dit.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from spindle.config import Section
from spindle.train.rewards.config import RewardConfig, RewardList, check_kind, weighted_rewards


class FlowGrpoConfig(Section):
    """`flow_grpo:` Flow-GRPO (DanceGRPO for video families): each step samples `num_generations` outputs per
    prompt with the SDE sampler, scores them with `rewards`, and optimises the clipped objective on
    group-relative advantages. Defaults are the Flow-GRPO repository's."""

    num_generations: int = Field(
        8, ge=2, description="samples per prompt, one group (advantages are relative to the group's rewards)"
    )
    num_inference_steps: int = Field(10, ge=1, description="denoising steps of a rollout (the SDE sampler's)")
    noise_level: float = Field(
        0.7,
        gt=0,
        description="the SDE sampler's noise: std_dev_t = noise_level * sqrt(sigma / (1 - sigma)); 0 would be the "
        "deterministic sampler, which has no log-probability",
    )
    guidance_scale: float | None = Field(
        None,
        description="the rollouts' guidance scale, as the family's sampling reads it (CFG, or a "
        "guidance-distilled model's embedded guidance); default: the family's sampling default",
    )
    clip_range: float = Field(
        1e-4, gt=0, description="PPO clip: the probability ratio is clipped to [1 - clip_range, 1 + clip_range]"
    )
    adv_clip_max: float = Field(5.0, gt=0, description="advantages are clamped to [-adv_clip_max, adv_clip_max]")
    num_iterations: int = Field(
        1, ge=1, description="policy updates on each batch of rollouts (1: on-policy; ratios start at 1)"
    )
    timestep_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the fraction of a rollout's denoising steps the loss covers, from the first (noisiest) one",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="weight of the KL to the reference (the starting weights; LoRA: the base with adapters off); "
        "0: no reference forward",
    )
    global_std: bool = Field(
        False, description="normalise advantages by the whole batch's reward std instead of each group's"
    )
    rewards: RewardList = Field(
        description="the rewards, each `path/to/file.py:function`, `module:function`, an http(s) URL, "
        "`builtin:NAME`, or a mapping {fn|url|builtin, weight, name, ...} (docs/post-training-dit.md)"
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward (instead of each reward's own weight); default 1 each"
    )

    @model_validator(mode="after")
    def _rewards(self) -> FlowGrpoConfig:
        check_kind(weighted_rewards(self.rewards, self.reward_weights, "flow_grpo"), "dit", "flow_grpo")
        return self

    @property
    def reward_configs(self) -> list[RewardConfig]:
        """The rewards with `reward_weights` applied (what `load_rewards` takes)."""
        return weighted_rewards(self.rewards, self.reward_weights, "flow_grpo")


class DiffusionDpoConfig(Section):
    """`diffusion_dpo:` Diffusion-DPO on preference pairs, in its flow-matching form."""

    beta: float = Field(
        100.0,
        gt=0,
        description="the DPO temperature on the difference of the policy's and the reference's flow-matching "
        "errors (Flow-GRPO's DPO baseline: 100); larger: a sharper preference, a smaller step off the reference",
    )
