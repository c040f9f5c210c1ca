"""VLM LoRA training, and HSDP of the natively multimodal families (Qwen3.5, Gemma 3 image-text), on real torchrun
workers (gloo on CPU) equals one process. (Full fine-tuning of every
VLM family under dp_shard=2 with a text-only rank, sp=2 and, for MoE families, ep=2:
tests/conformance/test_vlm_conformance.py::test_two_processes_equal_one.)

The runs train the suite's reference steps (`vlm_conformance.REFERENCE_RUN` on `REFERENCE_LINES`: image,
text-only, image, text-only, one conversation per row, global batch 2 in micro-batches of 1, so with
dp_shard=2 rank 1 only ever sees text-only rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.testing.vlm_conformance import REFERENCE_LINES, REFERENCE_RUN, subset
from spindle.train.metrics import read_metrics
from tests.conftest import spindle_train, vlm_overrides

pytestmark = pytest.mark.slow


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    spindle_train(out, nproc, vlm_overrides(model, data, out, **{**REFERENCE_RUN, **overrides}))


@pytest.fixture(scope="module")
def data(vlm_conversations, tmp_path_factory) -> Path:
    return subset(vlm_conversations, tmp_path_factory.mktemp("vlm_rows"), REFERENCE_LINES)


def test_lora_dp_shard2_equals_one_process(tiny_qwen2_5_vl, data, tmp_path):
    """LoRA adapters inside the FSDP2 units (frozen base sharded with them), a text-only rank, and the
    collective adapter gather of the export: the same losses, grad norms and PEFT adapter file."""
    from safetensors.torch import load_file

    lora = dict(train__lora='{"rank": 4}', train__lr=1e-2)
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(tiny_qwen2_5_vl, data, one, nproc=1, **lora)
    run_train(tiny_qwen2_5_vl, data, two, nproc=2, parallel__dp_shard=2, **lora)
    ma, mb = read_metrics(one), read_metrics(two)
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    adapters = "export/lora/adapter_model.safetensors"
    wa, wb = load_file(one / adapters), load_file(two / adapters)
    assert wa.keys() == wb.keys() and len(wa) > 0
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["qwen3_5", "gemma3_vl"])
def test_hsdp_equals_one_process(name, tiny_checkpoint, data, tmp_path):
    """HSDP (parallel.dp_replicate=2 over dp_shard=1: each replica holds the whole model, gradients all-reduced
    between them) with one replica's rows text-only: the same losses, grad norms and exported weights as one
    process."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import check_same_run

    model = tiny_checkpoint(name)
    one, two = tmp_path / "one", tmp_path / "two"
    run_train(model, data, one, nproc=1)
    run_train(model, data, two, nproc=2, parallel__dp_replicate=2, parallel__dp_shard=1)
    check_same_run(get_family(name), one, two)
