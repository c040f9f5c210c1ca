"""Causal-LM training on real torchrun workers (gloo, CPU) equals one process: what the conformance suite
does not cover (its dp_shard=2 and SP=2 runs: tests/conformance/test_causal_lm_conformance.py).

Every run trains the suite's reference run (`REFERENCE_RUN`: 4 steps, global batch 8 of unpacked rows of
text and chat documents, very different learned-token counts per row); only the layout differs.
Tolerance: fp32 CPU, 1e-5 relative on per-step loss and grad norm; exported weights 1e-4 absolute after 4
AdamW steps at lr 1e-3 (see tests/distributed/test_train_distributed.py for why weights get an absolute bound).
"""

from __future__ import annotations

import pytest

from spindle.registry import get_family
from spindle.testing.causal_lm_conformance import REFERENCE_RUN, check_same_run
from spindle.train.metrics import read_metrics
from tests.conftest import lm_train_cli

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__dp_shard": 2, "train__gradient_checkpointing": True},
        {"parallel__dp_replicate": 2, "parallel__dp_shard": 1},
    ],
    ids=["dp_shard2_activation_checkpointing", "hsdp_replicate2"],
)
def test_two_processes_equal_one(layout, lm_reference_run, tiny_qwen3, lm_corpus, tmp_path):
    out = tmp_path / "run"
    lm_train_cli(tiny_qwen3, lm_corpus, out, 2, **{**REFERENCE_RUN, **layout})
    check_same_run(get_family("qwen3"), lm_reference_run("qwen3"), out)


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)], ids=["save2_resume1", "save1_resume2"])
def test_resume_across_world_sizes(first, second, lm_reference_run, tiny_qwen3, lm_corpus, tmp_path):
    out = tmp_path / "run"
    lm_train_cli(
        tiny_qwen3, lm_corpus, out, first, **{**REFERENCE_RUN, "train__max_steps": 2, "checkpoint__export": False}
    )
    lm_train_cli(tiny_qwen3, lm_corpus, out, second, **{**REFERENCE_RUN, "checkpoint__resume": "auto"})
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    check_same_run(get_family("qwen3"), lm_reference_run("qwen3"), out)
