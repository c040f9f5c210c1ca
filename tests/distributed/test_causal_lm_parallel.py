"""Causal-LM training with Ulysses SP on real torchrun workers (gloo on CPU) equals one process: what the
conformance suite does not cover (its SP=2 run of every family: tests/conformance/test_causal_lm_conformance.py).

Every run trains the same 4 steps of a tiny Qwen3 with ONE key/value head (so every SP run repeats KV
heads: fewer KV heads than sp) on the same packed text + chat rows (14 rows of 48 tokens, so the steps
cross epoch boundaries), global batch 8 in micro-batches of 2; only the layout differs. The step loss
(mean over the global batch's valid tokens, uneven across rows, micro-batches and SP chunks) and the grad
norm must match one process to 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spindle.registry import get_family
from spindle.testing.causal_lm_conformance import check_same_run
from tests.conftest import lm_overrides, lm_train_cli

pytestmark = pytest.mark.slow
RUN = dict(train__max_steps=4, train__micro_batch_size=2, checkpoint__export=False)  # packed rows (the default)


@pytest.fixture(scope="module")
def qwen3_kv1(tmp_path_factory) -> Path:
    from spindle.models.qwen3.tiny import build_tiny as build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "qwen3_kv1", transformer={"num_key_value_heads": 1})


@pytest.fixture(scope="module")
def single(qwen3_kv1, lm_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    lm_train_cli(qwen3_kv1, lm_corpus, out, 1, **RUN)
    return out


def test_dp_shard2_x_sp2_with_repeated_kv_heads_equals_one_process(single, qwen3_kv1, lm_corpus, tmp_path):
    """4 ranks: SP=2 inside each of 2 FSDP shards, packed rows (per-document positions computed before the
    split), one KV head repeated for the 2 SP ranks. (SP=2 alone on 2 ranks: the conformance suite.)"""
    out = tmp_path / "run"
    lm_train_cli(qwen3_kv1, lm_corpus, out, 4, **RUN, parallel__dp_shard=2, parallel__sp=2)
    check_same_run(get_family("qwen3"), single, out, weights=False)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"parallel__sp": 2, "parallel__dp_shard": 1, "data__seq_len": 47}, 2, r"data\.seq_len=47 .*parallel\.sp=2"),
        ({"parallel__sp": 3, "parallel__dp_shard": 1}, 3, r"4 attention heads \(num_attention_heads\).*parallel\.sp=3"),
    ],
    ids=["seq_len", "heads"],
)
def test_impossible_sp_layout_fails_before_work(overrides, world, message, tiny_qwen3, lm_corpus, tmp_path):
    from spindle.api import check_job_plan, load_job_config

    cfg = load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path / "o", **overrides))
    with pytest.raises(ValueError, match=message):
        check_job_plan(cfg, world)
