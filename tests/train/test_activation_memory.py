"""The start-of-run activation estimate (spindle.train.memory.activation_memory): what it scales with, what the
dense document mask adds, and that the summary carries it."""

from __future__ import annotations

import json

import pytest

from spindle.train.memory import activation_memory
from tests.conftest import lm_train

QWEN3_0_6B = {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072}


def estimate(**values):
    args = {"rows": 1, "seq_len": 32768, "sp": 1, "bytes_per_value": 2, "checkpointing": False, "dense_mask": False}
    return activation_memory(QWEN3_0_6B, **(args | values))


def test_the_estimate_is_linear_in_the_row_without_a_dense_mask_and_quadratic_with_one():
    assert estimate(seq_len=65536).total_gb == pytest.approx(2 * estimate().total_gb)
    assert estimate(sp=2).total_gb == pytest.approx(estimate().total_gb / 2)
    dense = estimate(dense_mask=True)
    assert dense.mask_gb == pytest.approx(32768**2 * 5 / 1e9) and dense.layers_gb == estimate().layers_gb
    assert estimate(seq_len=65536, dense_mask=True).mask_gb == pytest.approx(4 * dense.mask_gb)
    assert estimate(checkpointing=True).total_gb < estimate().total_gb / 5  # one layer's set + the layer inputs
    assert "estimate" in estimate().describe()


def test_the_start_summary_prints_the_activation_estimate(tiny_qwen3, lm_corpus, tmp_path):
    lm_train(tiny_qwen3, lm_corpus, tmp_path / "run", train__max_steps=1, checkpoint__export=False)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["start"]
    act = summary["activation_memory"]
    assert act["tokens"] == 4 * 48 and act["mask_gb"] == 0 and act["total_gb"] > 0  # varlen: no [S, S] mask
