"""kill -9 + `checkpoint.resume: auto` on the language-model families added after Qwen3 / Llama / Qwen3-MoE, whose
training state differs in what a checkpoint must hold: a dense model with sliding-window layers (Gemma 3), shared
and routed experts with MLA (DeepSeek-V3), biased fused experts with attention sinks (GPT-OSS), and Qwen2's plain
decoder; and the natively multimodal ones on image conversations (Qwen3.5: Gated DeltaNet state and a vision
tower; Gemma 3 image-text: packed rows with bidirectional image blocks). Each run is SIGKILLed as step 3 begins and
resumed from the step-2 checkpoint: steps 1-4 log the uninterrupted run's losses and grad norms exactly (CPU fp32,
the same rows in the same steps)."""

from __future__ import annotations

import pytest

from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, lm_train, spindle_train_killed, vlm_overrides, vlm_train


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "deepseek_v3", "gpt_oss"])
def test_a_killed_run_resumes_exactly(name, tiny_checkpoint, lm_corpus, tmp_path):
    model = tiny_checkpoint(name)
    values = dict(
        train__max_steps=4, checkpoint__every_steps=2, checkpoint__export=False, data__shuffle=True,
        train__global_batch_size=4, train__micro_batch_size=2, train__lr=1e-2,
    )  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    lm_train(model, lm_corpus, whole, **values)
    spindle_train_killed(killed, lm_overrides(model, lm_corpus, killed, **values), at_step=3)
    lm_train(model, lm_corpus, killed, **{**values, "checkpoint__resume": "auto"})
    assert_same_steps(killed, whole)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_vl"])
def test_a_killed_vlm_run_resumes_exactly(name, tiny_checkpoint, vlm_conversations, tmp_path):
    """Image and text-only conversations, shuffled, in the family's default rows (Gemma 3: packed)."""
    model = tiny_checkpoint(name)
    values = dict(
        train__max_steps=4, checkpoint__every_steps=2, checkpoint__export=False, data__shuffle=True,
        train__global_batch_size=2, train__lr=1e-2, data__seq_len=160,
    )  # fmt: skip
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    vlm_train(model, vlm_conversations, whole, **values)
    spindle_train_killed(killed, vlm_overrides(model, vlm_conversations, killed, **values), at_step=3)
    vlm_train(model, vlm_conversations, killed, **{**values, "checkpoint__resume": "auto"})
    assert_same_steps(killed, whole)


def assert_same_steps(resumed, whole):
    got, want = read_metrics(resumed), read_metrics(whole)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in got] == [m[key] for m in want], key
