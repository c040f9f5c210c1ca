"""Causal-LM training on real torchrun workers (gloo, CPU) equals one process.

Every run trains the same 4 steps, global batch 8 of unpadded-length rows (text and chat documents:
very different learned-token counts per row), only the layout differs. Tolerance: fp32 CPU, 1e-5
relative on per-step loss and grad norm; exported weights 1e-4 absolute after 4 AdamW steps at lr 1e-3
(see tests/test_train_distributed.py for why weights get an absolute bound).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides

pytestmark = pytest.mark.slow
RTOL = 1e-5
WEIGHT_ATOL = 1e-4


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text(yaml.safe_dump({}))
    base = dict(train__max_steps=4, train__micro_batch_size=2, data__packing=False)
    args = lm_overrides(model, data, out, **{**base, **overrides})
    cmd = [sys.executable, "-m", "spindle", "train", str(cfg), *args, "--nproc", str(nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def exported(out: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((out / "export").glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def assert_same_run(a: Path, b: Path) -> None:
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in read_metrics(b)] == pytest.approx([m[key] for m in read_metrics(a)], rel=RTOL), key
    wa, wb = exported(a), exported(b)
    assert wa.keys() == wb.keys() and wa
    worst = max(wa, key=lambda k: (wb[k] - wa[k]).abs().max().item())
    assert (wb[worst] - wa[worst]).abs().max().item() <= WEIGHT_ATOL, worst


@pytest.fixture(scope="module")
def single(tiny_qwen3, lm_corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lm_single") / "run"
    run_train(tiny_qwen3, lm_corpus, out, nproc=1)
    return out


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__dp_shard": 2},
        {"parallel__dp_shard": 2, "train__gradient_checkpointing": True},
        {"parallel__dp_replicate": 2, "parallel__dp_shard": 1},
    ],
    ids=["dp_shard2", "dp_shard2_activation_checkpointing", "hsdp_replicate2"],
)
def test_two_processes_equal_one(layout, single, tiny_qwen3, lm_corpus, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_qwen3, lm_corpus, out, nproc=2, **layout)
    assert_same_run(single, out)


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)], ids=["save2_resume1", "save1_resume2"])
def test_resume_across_world_sizes(first, second, single, tiny_qwen3, lm_corpus, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_qwen3, lm_corpus, out, nproc=first, train__max_steps=2, checkpoint__export=False)
    run_train(tiny_qwen3, lm_corpus, out, nproc=second, checkpoint__resume="auto")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert_same_run(single, out)
