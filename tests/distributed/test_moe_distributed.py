"""Qwen3-MoE with expert parallelism on real torchrun workers (gloo, CPU) equals one process: what the
conformance suite does not cover (its 2-process ep=2, dp_shard=2 (ep=1) and SP=2 runs:
tests/conformance/test_causal_lm_conformance.py).

Every run trains the suite's reference run (`REFERENCE_RUN`: 4 steps, global batch 8 of unpacked chat/text
rows); only the layout differs. fp32 CPU: per-step loss, aux loss and grad norm 1e-5 relative, the same
expert load; exported weights 1e-4 absolute after AdamW at lr 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spindle.registry import get_family
from spindle.testing.causal_lm_conformance import REFERENCE_RUN, check_same_run, exported_weights
from spindle.train.metrics import read_metrics
from tests.conftest import assert_same_lora_run, lm_train_cli

pytestmark = pytest.mark.slow


def assert_same_run(a: Path, b: Path) -> None:
    check_same_run(get_family("qwen3_moe"), a, b)
    assert any(".experts.0.gate_proj.weight" in k for k in exported_weights(a)), "the export is not per-expert"


def test_ep2_times_dp_shard2_equals_one_process(lm_reference_run, tiny_qwen3_moe, lm_corpus, tmp_path):
    """4 ranks: experts split over ep=2 and FSDP2-sharded over the 2 ranks holding the same experts.
    Micro-batches of 2 rows as in the 1-process run (the aux loss is per micro-batch, so the split must match)."""
    out = tmp_path / "run"
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 4, **REFERENCE_RUN, parallel__ep=2)
    assert_same_run(lm_reference_run("qwen3_moe"), out)


@pytest.mark.parametrize(
    "layout",
    [{"parallel__ep": 2, "parallel__sp": 2}, {"parallel__ep": 2, "parallel__dp_replicate": 2, "parallel__dp_shard": 2}],
    ids=["ep2_sp2", "hsdp_replicate2_ep2"],
)
def test_four_process_layouts_equal_one_process(layout, lm_reference_run, tiny_qwen3_moe, lm_corpus, tmp_path):
    """ep2_sp2: the two SP ranks of a data-parallel rank hold the same experts and different tokens of the
    same rows, so the experts' FSDP2 units reduce over them too. hsdp_replicate2_ep2: the experts are
    replicated over dp_replicate and split over ep."""
    out = tmp_path / "run"
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 4, **REFERENCE_RUN, **layout)
    assert_same_run(lm_reference_run("qwen3_moe"), out)


def test_resume_an_ep2_checkpoint_at_ep1(lm_reference_run, tiny_qwen3_moe, lm_corpus, tmp_path):
    out = tmp_path / "run"
    first = {**REFERENCE_RUN, "train__max_steps": 2, "checkpoint__export": False}
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 2, **first, parallel__ep=2)
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 1, **REFERENCE_RUN, checkpoint__resume="auto")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert_same_run(lm_reference_run("qwen3_moe"), out)


# adam_eps 1e-4: AdamW's update lr * g / (|g| + eps) has slope up to lr / eps in g, so at the default 1e-8
# an adapter element whose gradient is about 0 turns the layouts' float32 summation-order noise (~1e-9)
# into ~1e-4 differences (tests/distributed/test_expert_lora_multimodal.py says more); here it left 6.9e-6
# of the 1e-5 tolerance at ep=2.
EXPERT_LORA = dict(
    REFERENCE_RUN,
    train__lora='{"rank": 4, "alpha": 8, "targets": ["q_proj", "experts"]}',
    train__lr=1e-2,
    train__adam_eps=1e-4,
)


@pytest.fixture(scope="module")
def expert_lora_one(tiny_qwen3_moe, lm_corpus, tmp_path_factory) -> Path:
    """One process training LoRA on the fused experts and q_proj: what the 2-process layouts must equal."""
    out = tmp_path_factory.mktemp("expert_lora") / "one"
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 1, **EXPERT_LORA)
    return out


@pytest.mark.parametrize(
    "layout",
    [{"parallel__dp_shard": 2}, {"parallel__sp": 2}, {"parallel__ep": 2}],
    ids=["dp_shard2", "sp2", "ep2"],
)
def test_expert_lora_two_processes_equal_one(layout, expert_lora_one, tiny_qwen3_moe, lm_corpus, tmp_path):
    """LoRA on the fused experts (held stacked by expert, added to the expert weights inside the experts'
    forward: spindle.train.expert_lora) and on q_proj, the frozen base and the adapters FSDP2-sharded over
    dp_shard=2, each row split over sp=2, or the experts and their adapters split over ep=2 (each rank
    adapting its own experts' local weights): the same losses, aux losses, grad norms and exported PEFT
    adapters as one process."""
    two = tmp_path / "two"
    lm_train_cli(tiny_qwen3_moe, lm_corpus, two, 2, **EXPERT_LORA, **layout)
    assert_same_lora_run(expert_lora_one, two)


def test_expert_lora_ep2_times_dp_shard2_resumes_at_one_process(expert_lora_one, tiny_qwen3_moe, lm_corpus, tmp_path):
    """4 ranks: the expert adapters split over ep=2 with their experts and FSDP2-sharded over the 2 ranks
    holding the same experts; its checkpoint (DCP, adapters and their optimizer state stacked by expert)
    resumes on one process: every step and the export equal the one-process run."""
    out = tmp_path / "run"
    first = {**EXPERT_LORA, "train__max_steps": 2, "checkpoint__export": False}
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 4, **first, parallel__ep=2)
    lm_train_cli(tiny_qwen3_moe, lm_corpus, out, 1, **EXPERT_LORA, checkpoint__resume="auto")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert_same_lora_run(expert_lora_one, out)
