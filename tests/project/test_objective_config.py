"""The post-training config sections (`dpo:`, `reward:`, `grpo:`, `flow_grpo:`, `diffusion_dpo:` in spindle.config): strict like every section,
each field described, the rules across fields named, and the defaults TRL 1.16's where a TRL setting corresponds."""

from __future__ import annotations

import dataclasses
import os

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPO (simpo's defaults) lives in trl.experimental

import trl
from trl.experimental.cpo import CPOConfig

from spindle.config import (
    ConfigError,
    DiffusionDpoConfig,
    DPOConfig,
    FlowGrpoConfig,
    GRPOConfig,
    RewardConfig,
    RewardSpec,
    Section,
    validate_config,
)


class Job(Section):
    """The sections as a job holds them (top-level, named after the objective)."""

    dpo: DPOConfig = DPOConfig()
    reward: RewardConfig = RewardConfig()
    grpo: GRPOConfig = GRPOConfig()


def invalid(raw):
    with pytest.raises(ConfigError) as e:
        validate_config(raw, Job)
    return str(e.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"dpo": {"bta": 0.2}}, "unknown key 'dpo.bta'; did you mean 'dpo.beta'?"),
        ({"dpo": {"reference": "x"}}, "did you mean 'dpo.reference_model'?"),
        ({"grpo": {"num_generation": 4}}, "did you mean 'grpo.num_generations'?"),
        ({"grpo": {"epsilon_hi": 0.3}}, "did you mean 'grpo.epsilon_high'?"),
        ({"reward": {"margin": True}}, "did you mean 'reward.use_margin'?"),
        ({"dpo": {"loss_type": "hinge"}}, "'dpo.loss_type': Input should be 'sigmoid', 'ipo' or 'simpo'"),
        ({"dpo": {"beta": 0}}, "'dpo.beta': Input should be greater than 0"),
        ({"dpo": {"label_smoothing": 0.5}}, "'dpo.label_smoothing': Input should be less than 0.5"),
        ({"dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, "does not apply to dpo.loss_type ipo"),
        ({"dpo": {"gamma": 0.5}}, "dpo.gamma is simpo's target margin; dpo.loss_type sigmoid does not use it"),
        ({"dpo": {"loss_type": "simpo", "reference_model": "/m"}}, "simpo is reference-free"),
        ({"grpo": {"num_generations": 1}}, "'grpo.num_generations': Input should be greater than or equal to 2"),
        ({"grpo": {"top_p": 1.5}}, "'grpo.top_p': Input should be less than or equal to 1"),
        ({"grpo": {"scale_rewards": True}}, "'grpo.scale_rewards': Input should be 'group', 'batch' or 'none'"),
        ({"grpo": {"loss_type": "bnpo"}}, "'grpo.loss_type': Input should be 'grpo', 'dr_grpo' or 'dapo'"),
        (
            {"grpo": {"rewards": ["a.py:f", "b.py:g"], "reward_weights": [1.0]}},
            "grpo.reward_weights has 1 entries for 2 rewards",
        ),
    ],
)
def test_bad_values_are_named(raw, message):
    assert message in invalid(raw)


def test_good_sections_validate():
    job = validate_config(
        {
            "dpo": {"loss_type": "simpo", "gamma": 1.0, "beta": 2.0, "label_smoothing": 0.1},
            "reward": {"use_margin": False, "center_rewards_coefficient": 0.01},
            "grpo": {"rewards": ["r.py:f", "pkg.mod:g"], "reward_weights": [1.0, 0.5], "epsilon_high": 0.28},
        },
        Job,
    )
    assert (job.dpo.simpo_gamma, DPOConfig(loss_type="simpo").simpo_gamma) == (1.0, 0.5)
    assert job.grpo.reward_weights == [1.0, 0.5]


@pytest.mark.parametrize(
    "section", [DPOConfig, RewardConfig, GRPOConfig, FlowGrpoConfig, DiffusionDpoConfig, RewardSpec]
)
def test_every_field_is_described(section):
    assert [name for name, f in section.model_fields.items() if not f.description] == []


def trl_defaults(config_class):
    return {f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}


def test_defaults_are_trls():
    dpo, cpo, grpo = trl_defaults(trl.DPOConfig), trl_defaults(CPOConfig), trl_defaults(trl.GRPOConfig)
    ours_dpo, ours_grpo = DPOConfig(), GRPOConfig()
    assert (ours_dpo.beta, ours_dpo.label_smoothing) == (dpo["beta"], dpo["label_smoothing"])
    assert DPOConfig(loss_type="simpo").simpo_gamma == cpo["simpo_gamma"]
    assert [getattr(ours_grpo, k) for k in ("num_generations", "temperature", "top_p", "beta", "num_iterations")] == [
        grpo[k] for k in ("num_generations", "temperature", "top_p", "beta", "num_iterations")
    ]
    assert (ours_grpo.epsilon, ours_grpo.epsilon_high) == (grpo["epsilon"], grpo["epsilon_high"])
    assert (ours_grpo.loss_type, ours_grpo.scale_rewards) == (grpo["loss_type"], grpo["scale_rewards"])
    assert ours_grpo.max_new_tokens == grpo["max_completion_length"]
