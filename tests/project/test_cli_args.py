"""Command lines as users type them: launcher flags anywhere among the overrides, and user errors as one
line with exit code 2 (no traceback)."""

from __future__ import annotations

import json

import yaml

from tests.conftest import train_overrides


def test_nproc_anywhere_among_the_overrides(spindle_cli, tiny_wan, shapes_videos, tmp_path):
    """`spindle train CONFIG --nproc 1 key=value`: the override after the flag is applied (argparse alone
    stopped filling the overrides at --nproc and called the rest unrecognized)."""
    run = tmp_path / "run"
    overrides = train_overrides(tiny_wan, shapes_videos, run, train__max_steps=1, checkpoint__export=False)
    config = tmp_path / "job.yaml"
    raw: dict = {}
    for item in overrides:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(value)
    config.write_text(yaml.safe_dump(raw))
    result = spindle_cli("train", config, "--nproc", "1", "train.max_steps=2")
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_a_real_unknown_flag_is_still_refused(spindle_cli, tmp_path):
    result = spindle_cli("train", tmp_path / "job.yaml", "--nproc", "1", "--no-such-flag", "train.lr=1")
    assert result.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in result.stderr


def test_generate_on_a_language_model_is_one_line_and_exit_2(spindle_cli, tiny_qwen3, tmp_path):
    result = spindle_cli("generate", "--model", tiny_qwen3, "--prompt", "hi", "--out", tmp_path / "x.png")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert (len(lines) == 1 and "language model" in lines[0]) or "causal_lm" in lines[0], result.stderr
    assert "AutoModelForCausalLM" in lines[0]
