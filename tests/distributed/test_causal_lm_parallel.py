"""Causal-LM training with Ulysses SP on real torchrun workers (gloo on CPU) equals one process.

(FSDP2 / HSDP alone, and resume across world sizes: tests/test_causal_lm_distributed.py.)

Every run trains the same 4 steps of the tiny Qwen3 (GQA with ONE key/value head, so every SP run
repeats KV heads: fewer KV heads than sp) on the same packed text + chat rows (14 rows of 48
tokens, so the steps cross epoch boundaries), global batch 8 in micro-batches of 2; only the layout
differs. The step loss (mean over the global batch's valid tokens, uneven across rows,
micro-batches and SP chunks) and the grad norm must match one process to 1e-5 relative. A tiny
Llama (2 KV heads = sp: no repetition) checks SP for the second family.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides

pytestmark = pytest.mark.slow
RTOL = 1e-5
STEPS = 4


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text(yaml.safe_dump({}))
    base = dict(train__max_steps=STEPS, train__micro_batch_size=2, checkpoint__export=False)
    args = lm_overrides(model, data, out, **{**base, **overrides})
    cmd = [sys.executable, "-m", "spindle", "train", str(cfg), *args, "--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=RTOL), key


@pytest.fixture(scope="module")
def qwen3_kv1(tmp_path_factory) -> Path:
    from spindle.models.qwen3.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "qwen3_kv1", transformer={"num_key_value_heads": 1})


@pytest.fixture(scope="module")
def single(qwen3_kv1, lm_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_train(qwen3_kv1, lm_corpus, out, nproc=1)
    return out


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, {"parallel__sp": 2, "parallel__dp_shard": 1}),
        (4, {"parallel__dp_shard": 2, "parallel__sp": 2}),
    ],
    ids=["sp2", "dp_shard2_x_sp2"],
)
def test_parallel_layout_equals_one_process(nproc, layout, single, qwen3_kv1, lm_corpus, tmp_path):
    out = tmp_path / "run"
    run_train(qwen3_kv1, lm_corpus, out, nproc=nproc, **layout)
    assert_same_run(single, out)


def test_llama_sp2_equals_one_process(tiny_llama, lm_corpus, tmp_path):
    one, sp2 = tmp_path / "one", tmp_path / "sp2"
    run_train(tiny_llama, lm_corpus, one, nproc=1)
    run_train(tiny_llama, lm_corpus, sp2, nproc=2, parallel__sp=2, parallel__dp_shard=1)
    assert_same_run(one, sp2)


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
