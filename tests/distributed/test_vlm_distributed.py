"""VLM training on real torchrun workers (gloo on CPU) equals one process: FSDP2 over vision blocks and
decoder layers with one rank's micro-batches text-only (its vision tower runs the zero-weight dummy
forward, so the FSDP2 collectives match and nothing hangs), and Ulysses SP over the language model
(3-D positions computed on whole documents before the split, vision filled in before the cut).

Each run trains the same 2 steps of a tiny Qwen2.5-VL / Qwen3-VL (deepstack features cut with the sequence
under SP, and part of the dummy forward) on 4 conversations, one per row, in order
(image, text-only, image, text-only): global batch 2 in micro-batches of 1, so with dp_shard=2 rank 1
only ever sees text-only rows. Loss and grad norm match one process to 1e-5 relative, the exported
weights to 1e-5.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spindle.train.metrics import read_metrics
from tests.train.test_vlm import subset, vlm_overrides

pytestmark = pytest.mark.slow
STEPS = 2
WEIGHTS = "export/model-00001-of-00001.safetensors"


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text("{}\n")
    base = dict(train__max_steps=STEPS, train__global_batch_size=2, data__packing=False, checkpoint__export=True)
    args = vlm_overrides(model, data, out, **{**base, **overrides})
    cmd = [sys.executable, "-m", "spindle", "train", str(cfg), *args, "--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def data(vlm_conversations, tmp_path_factory) -> Path:
    return subset(vlm_conversations, tmp_path_factory.mktemp("vlm_rows"), [0, 3, 1, 7])  # 3, 7: text-only


@pytest.fixture(scope="module")
def singles(data, tiny_checkpoint, tmp_path_factory):
    """family -> its one-process run (made on first use)."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            runs[family] = tmp_path_factory.mktemp(f"single_{family}") / "run"
            run_train(tiny_checkpoint(family), data, runs[family], nproc=1)
        return runs[family]

    return get


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize(
    "layout",
    [{"parallel__dp_shard": 2}, {"parallel__sp": 2, "parallel__dp_shard": 1}],
    ids=["dp_shard2_text_only_rank", "sp2"],
)
def test_layout_equals_one_process(layout, family, singles, tiny_checkpoint, data, tmp_path):
    from safetensors.torch import load_file

    single = singles(family)
    out = tmp_path / "run"
    run_train(tiny_checkpoint(family), data, out, nproc=2, **layout)
    ma, mb = read_metrics(single), read_metrics(out)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    wa, wb = load_file(single / WEIGHTS), load_file(out / WEIGHTS)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


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
