"""`train.cpu_offload` under torchrun (gloo on CPU): FSDP2's CPUOffloadPolicy on 2 processes trains the
one-process run (same bounds as tests/distributed/test_train_distributed.py), with LoRA (frozen base
shards offloaded too), and the start of the run reports peak memory for both ranks."""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from tests.distributed.test_train_distributed import RTOL, WEIGHT_ATOL, run_train, series

pytestmark = pytest.mark.slow
LORA = dict(train__lora="{rank: 4, alpha: 8}", train__max_steps=3)


def test_cpu_offload_two_processes_equal_one(tiny_wan, shapes_videos, tmp_path):
    single, offload = tmp_path / "single", tmp_path / "offload"
    run_train(tiny_wan, shapes_videos, single, nproc=1, **LORA)
    proc = run_train(tiny_wan, shapes_videos, offload, nproc=2, parallel__dp_shard=2, train__cpu_offload=True, **LORA)
    for key in ("loss", "grad_norm"):
        assert series(offload, key) == pytest.approx(series(single, key), rel=RTOL), key
    name = "export/lora/pytorch_lora_weights.safetensors"
    a, b = load_file(single / name), load_file(offload / name)
    assert a.keys() == b.keys() and len(a) > 0
    assert max(abs(b[k] - a[k]).max().item() for k in a) <= WEIGHT_ATOL
    output = proc.stdout + proc.stderr
    for when in ("after load", "after step 1"):
        assert re.search(rf"peak memory {when}: rank 0: host [\d.]+ GB; rank 1: host [\d.]+ GB", output), when
