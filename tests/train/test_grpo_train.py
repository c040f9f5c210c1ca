"""`train.objective: grpo` end to end: completions sampled from the live policy, scored by a reward function in a
file, the clipped objective on group-relative advantages. The mean reward rises; a failing reward stops the run
naming itself and the prompt with the last checkpoint intact; two processes draw the same rollouts as one."""

from __future__ import annotations

import json

import pytest

from spindle.distributed.checkpoint import list_checkpoints, verify_checkpoint
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, lm_train_cli, run_spindle, spindle_train_killed

PROMPTS = ["Write:", "Say something", "Go on", "Next:", "Hello", "Tell me", "A story:", "Word:"]
REWARDS = '''
def letter_a(completions, **kwargs):
    """The share of the completion's characters that are 'a' (a verifiable reward a tiny model can learn)."""
    return [c.count("a") / max(len(c), 1) for c in completions]


def letter_a_logged(completions, **kwargs):
    """letter_a, each call logged as "PID COUNT" next to this file (who scored how many completions)."""
    import os, pathlib

    with open(pathlib.Path(__file__).with_name("calls.log"), "a") as log:
        log.write(f"{os.getpid()} {len(completions)}\\n")
    return letter_a(completions)


def needs_topic(prompts, completions, topic, **kwargs):
    """Uses an extra column of the prompt lines (passed by name)."""
    return [float(t in c) for c, t in zip(completions, topic)]


def breaks_on_step(completions, **kwargs):
    import os

    calls = int(os.environ.get("SPINDLE_TEST_CALLS", "0")) + 1
    os.environ["SPINDLE_TEST_CALLS"] = str(calls)
    if calls == 3:
        raise ValueError("the scorer lost its database")
    return [0.0] * len(completions)
'''


@pytest.fixture
def grpo_data(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "topic": "a"}) + "\n" for p in PROMPTS))
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARDS)
    return prompts, rewards


def grpo_values(rewards, function: str, **values):
    return {
        "train__objective": "grpo",
        "data__seq_len": 64,
        "train__global_batch_size": 4,
        "train__micro_batch_size": 4,
        "train__lr": 1e-2,
        "grpo__num_generations": 8,
        "grpo__max_new_tokens": 6,
        "grpo__rewards": f"[{rewards}:{function}]",
        **values,
    }


def train(tiny_qwen3, prompts, out, **values):
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text("{}\n")
    return run_spindle("train", cfg, *lm_overrides(tiny_qwen3, prompts, out, **values), timeout=900)


def test_the_mean_reward_rises_from_a_reward_function_in_a_file(tiny_qwen3, grpo_data, tmp_path):
    """`spindle train` with train.objective=grpo, 8 completions per prompt, no KL, lr 1e-2: the logged mean
    reward of a verifiable reward climbs well above where the random model starts; the metrics and the samples
    file carry what a user watches."""
    prompts, rewards = grpo_data
    proc = train(tiny_qwen3, prompts, tmp_path / "run", **grpo_values(rewards, "letter_a", train__max_steps=14))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = read_metrics(tmp_path / "run")
    first = sum(m["reward_mean"] for m in metrics[:3]) / 3
    last = sum(m["reward_mean"] for m in metrics[-3:]) / 3
    assert first < 0.15 and last > first + 0.15, [round(m["reward_mean"], 3) for m in metrics]
    for key in (
        "reward_std",
        "reward/letter_a",
        "completion_length",
        "generated_tokens_per_s",
        "clip_ratio/region_mean",
    ):
        assert key in metrics[0], key
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples" / "grpo.jsonl").read_text().splitlines()]
    assert len(samples) == 14 * 4 * 8 and {"step", "prompt", "completion", "reward"} <= set(samples[0])
    assert sorted({s["step"] for s in samples}) == list(range(1, 15))  # numbered as metrics.jsonl numbers steps
    assert (tmp_path / "run" / "export" / "config.json").is_file()


def test_extra_prompt_columns_reach_the_reward_by_name(tiny_qwen3, grpo_data, tmp_path):
    prompts, rewards = grpo_data
    proc = train(tiny_qwen3, prompts, tmp_path / "run", **grpo_values(rewards, "needs_topic", train__max_steps=1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reward/needs_topic" in read_metrics(tmp_path / "run")[0]


def test_a_reward_that_raises_stops_the_run_naming_it_with_the_last_checkpoint_intact(tiny_qwen3, grpo_data, tmp_path):
    prompts, rewards = grpo_data
    values = grpo_values(rewards, "breaks_on_step", train__max_steps=5, checkpoint__every_steps=1)
    proc = train(tiny_qwen3, prompts, tmp_path / "run", **values)
    assert proc.returncode != 0
    assert "breaks_on_step" in proc.stderr and "the scorer lost its database" in proc.stderr
    assert "prompt" in proc.stderr
    saved = list_checkpoints(tmp_path / "run")
    assert saved and saved[-1].name.endswith("2") and verify_checkpoint(saved[-1]) == []


def test_a_missing_reward_function_is_refused_before_any_model_loads(tiny_qwen3, grpo_data, tmp_path):
    prompts, rewards = grpo_data
    proc = train(tiny_qwen3, prompts, tmp_path / "run", **grpo_values(rewards, "no_such_reward"))
    assert proc.returncode != 0 and "no_such_reward" in proc.stderr
    assert "peak memory after load" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_two_processes_draw_the_rollouts_of_one(tiny_qwen3, grpo_data, tmp_path):
    """Completions are keyed on (seed, step, prompt, sample): dp_shard=2 samples, scores and optimises what one
    process does; under Ulysses sp=2 both ranks sample the same completions whole (SP paused for generation) and
    the update splits each row over them, the normalisers (loss_type grpo: each completion's token count) and the
    clip ratios counted over the whole rows. Rewards, losses, grad norms and clip ratios 1e-5 relative over 4 steps
    (two cycles of num_iterations=2 with a tight epsilon, so the second step of each clips). Each completion is
    scored once: by the rank that drew it (dp_shard=2: two scorers) or by the first rank of its SP group (sp=2: one
    scorer, not two; an HTTP or paid scorer counts each completion once)."""
    prompts, rewards = grpo_data
    values = grpo_values(rewards, "letter_a_logged", train__max_steps=4, train__micro_batch_size=2)
    values.update(checkpoint__export=False, grpo__loss_type="grpo", grpo__epsilon=0.02, grpo__num_iterations=2)
    values.update(checkpoint__every_steps=2, train__adam_eps=1e-4)
    calls = rewards.with_name("calls.log")

    def scorers() -> tuple[int, int]:
        """(how many processes scored, how many completions they scored) since the last call."""
        lines = [line.split() for line in calls.read_text().splitlines()]
        calls.unlink()
        return len({pid for pid, _ in lines}), sum(int(n) for _, n in lines)

    one = train(tiny_qwen3, prompts, tmp_path / "one", **values)
    assert one.returncode == 0, one.stderr[-2000:]
    scored = 4 * 8 * 2  # 4 prompts a step x 8 generations x 2 rollouts (num_iterations=2 over 4 steps)
    assert scorers() == (1, scored)
    layouts = {"dp_shard2": {"parallel__dp_shard": 2}, "sp2": {"parallel__sp": 2}}
    for name, layout in layouts.items():
        lm_train_cli(tiny_qwen3, prompts, tmp_path / name, 2, **layout, **values)
        assert scorers() == (2 if name == "dp_shard2" else 1, scored), name
    assert any(m["clip_ratio/region_mean"] > 0 for m in read_metrics(tmp_path / "one"))  # the counts are compared
    for name in layouts:
        for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / name), strict=True):
            for key in ("reward_mean", "loss", "grad_norm", "clip_ratio/region_mean", "completion_length"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (name, key)


@pytest.mark.slow
def test_a_reward_that_raises_under_sequence_parallelism_stops_every_rank_naming_it(tiny_qwen3, grpo_data, tmp_path):
    """Under sp=2 the SP group's first rank scores; what it raises reaches its peer, so both ranks stop with the
    reward's own error (none waits forever on a collective) and the last checkpoint stays intact."""
    prompts, rewards = grpo_data
    values = grpo_values(rewards, "breaks_on_step", train__max_steps=5, checkpoint__every_steps=1, parallel__sp=2)
    with pytest.raises(AssertionError) as failed:
        lm_train_cli(tiny_qwen3, prompts, tmp_path / "run", 2, **values)
    for rank in (0, 1):
        stderr = str(failed.value).split(f"--- rank {rank} stderr ---")[1].split("--- rank")[0]
        assert "breaks_on_step" in stderr and "the scorer lost its database" in stderr, (rank, stderr)
    saved = list_checkpoints(tmp_path / "run")
    assert saved and saved[-1].name.endswith("2") and verify_checkpoint(saved[-1]) == []


def test_demo_grpo_learns_the_verifiable_reward_it_writes(tmp_path):
    """`spindle demo --family qwen3 --objective grpo`: the reward file lands in the demo folder, the tiny random
    model's mean reward climbs from near 0, and the curve is printed at the end."""
    out = tmp_path / "demo"
    proc = run_spindle("demo", "--family", "qwen3", "--objective", "grpo", "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "def letter_a(" in (out / "data" / "rewards.py").read_text()
    curve = [m["reward_mean"] for m in read_metrics(out / "run")]
    assert len(curve) == 20
    assert sum(curve[:3]) / 3 < 0.15 and sum(curve[-3:]) / 3 > 0.35, [round(r, 3) for r in curve]
    assert "mean reward per step" in proc.stdout and f"step  20  {curve[-1]:.3f}" in proc.stdout
    assert (out / "run" / "samples" / "grpo.jsonl").is_file()


def test_demo_grpo_refuses_a_dit_family(tmp_path):
    proc = run_spindle("demo", "--family", "flux", "--objective", "grpo", "--out", tmp_path / "demo")
    assert proc.returncode != 0 and "text causal-LM family" in proc.stderr


def test_num_iterations_trains_each_batch_of_completions_several_steps(tiny_qwen3, grpo_data, tmp_path):
    """grpo.num_iterations=2: steps 1-2 train on one batch of completions, 3-4 on the next (the rewards repeat
    within a cycle). The second step's ratios are against the sampler's log-probabilities, so its loss differs
    from the first's (with ratios of 1 the two would be equal) and a tight epsilon clips; generation time is
    logged on the cycle's first step only. A kill -9 as step 4 begins resumes exactly from the step-2 checkpoint
    (checkpoints fall between cycles; the resumed run draws step 3's completions as the uninterrupted one did:
    each completion's noise is keyed on (seed, step, prompt, sample)); a max_steps that is not a multiple is
    refused before any model loads."""
    prompts, rewards = grpo_data
    values = grpo_values(
        rewards, "letter_a", train__max_steps=4, checkpoint__every_steps=2, checkpoint__export=False,
        grpo__num_iterations=2, grpo__epsilon=1e-3,
    )  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = train(tiny_qwen3, prompts, whole, **values)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = read_metrics(whole)
    assert got[0]["reward_mean"] == got[1]["reward_mean"] and got[2]["reward_mean"] == got[3]["reward_mean"]
    assert got[0]["clip_ratio/region_mean"] == 0.0 and got[1]["clip_ratio/region_mean"] > 0
    assert got[1]["loss"] != got[0]["loss"]
    assert got[0]["time/generation_s"] > 0 and got[1]["time/generation_s"] == 0.0
    spindle_train_killed(killed, lm_overrides(tiny_qwen3, prompts, killed, **values), at_step=4)
    proc = train(tiny_qwen3, prompts, killed, **{**values, "checkpoint__resume": "auto"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    for a, b in zip(got, read_metrics(killed), strict=True):
        for key in ("reward_mean", "loss", "grad_norm", "clip_ratio/region_mean"):
            assert b[key] == a[key], key
    proc = train(tiny_qwen3, prompts, tmp_path / "odd", **{**values, "train__max_steps": 3})
    assert proc.returncode != 0
    assert "grpo.num_iterations=2: train.max_steps (3) and checkpoint.every_steps (2) must be multiples" in proc.stderr
    assert "peak memory after load" not in proc.stdout + proc.stderr
