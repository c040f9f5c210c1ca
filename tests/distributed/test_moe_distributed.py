"""Qwen3-MoE with expert parallelism on real torchrun workers (gloo, CPU) equals one process.

Same 3 steps, global batch 8 of unpadded chat/text rows; only the layout differs. fp32 CPU: per-step
loss and grad norm 1e-5 relative; exported weights 1e-4 absolute after AdamW at lr 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spindle.train.metrics import read_metrics
from tests.distributed.test_causal_lm_distributed import exported
from tests.distributed.test_causal_lm_distributed import run_train as run_lm

pytestmark = pytest.mark.slow
RTOL = 1e-5
WEIGHT_ATOL = 1e-4
STEPS = 3


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    run_lm(model, data, out, nproc, **{"train__max_steps": STEPS, **overrides})


def assert_same_run(a: Path, b: Path) -> None:
    ma, mb = read_metrics(a), read_metrics(b)
    for key in ("loss", "grad_norm", "aux_loss"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=RTOL), key
    assert [m["moe_tokens_per_expert"] for m in mb] == [m["moe_tokens_per_expert"] for m in ma]
    wa, wb = exported(a), exported(b)
    assert wa.keys() == wb.keys() and any(".experts.0.gate_proj.weight" in k for k in wa)
    worst = max(wa, key=lambda k: (wb[k] - wa[k]).abs().max().item())
    assert (wb[worst] - wa[worst]).abs().max().item() <= WEIGHT_ATOL, worst


@pytest.fixture(scope="module")
def single(tiny_qwen3_moe, lm_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe_single") / "run"
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=1)
    return out


@pytest.mark.parametrize(
    "layout",
    [{"parallel__ep": 2}, {"parallel__ep": 1}, {"parallel__sp": 2, "parallel__dp_shard": 1}],
    ids=["ep2", "dp_shard2_ep1", "sp2"],
)
def test_two_processes_equal_one(layout, single, tiny_qwen3_moe, lm_corpus, tmp_path):
    """sp2: each rank holds half of every row's tokens; the aux loss must come from the router statistics
    summed over both (not each half's own), and the expert load must count each token once."""
    out = tmp_path / "run"
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=2, **layout)
    assert_same_run(single, out)


def test_ep2_times_dp_shard2_equals_one_process(single, tiny_qwen3_moe, lm_corpus, tmp_path):
    """4 ranks: experts split over ep=2 and FSDP2-sharded over the 2 ranks holding the same experts.
    Micro-batches of 2 rows as in the 1-process run (the aux loss is per micro-batch, so the split must match)."""
    out = tmp_path / "run"
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=4, parallel__ep=2)
    assert_same_run(single, out)


@pytest.mark.parametrize(
    "layout",
    [{"parallel__ep": 2, "parallel__sp": 2}, {"parallel__ep": 2, "parallel__dp_replicate": 2, "parallel__dp_shard": 2}],
    ids=["ep2_sp2", "hsdp_replicate2_ep2"],
)
def test_four_process_layouts_equal_one_process(layout, single, tiny_qwen3_moe, lm_corpus, tmp_path):
    """ep2_sp2: the two SP ranks of a data-parallel rank hold the same experts and different tokens of the
    same rows, so the experts' FSDP2 units reduce over them too. hsdp_replicate2_ep2: the experts are
    replicated over dp_replicate and split over ep."""
    out = tmp_path / "run"
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=4, **layout)
    assert_same_run(single, out)


def test_resume_an_ep2_checkpoint_at_ep1(single, tiny_qwen3_moe, lm_corpus, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=2, parallel__ep=2, train__max_steps=2, checkpoint__export=False)
    run_train(tiny_qwen3_moe, lm_corpus, out, nproc=1, checkpoint__resume="auto")
    assert [m["step"] for m in read_metrics(out)] == list(range(1, STEPS + 1))
    assert_same_run(single, out)
