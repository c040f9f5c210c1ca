"""`train.ema` under FSDP2: each rank keeps and saves only its shard of the average, and the average of
a dp_shard=2 run equals the one-process run's, as do runs resumed across the two world sizes.

Tolerance: the weights' (1e-4 absolute after 4 AdamW steps at lr 1e-3; see test_train_distributed.py):
the EMA is a fixed linear combination of the weights after each step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from spindle.api import load_job_config, train
from spindle.distributed import checkpoint as ckpt
from spindle.export.record import LORA_WEIGHTS
from tests.conftest import spindle_train, train_overrides

pytestmark = pytest.mark.slow
ATOL = 1e-4
COMMON = dict(
    train__max_steps=4,
    train__micro_batch_size=1,
    data__shuffle=True,
    checkpoint__every_steps=2,
    export__weights="both",
    train__ema__decay=0.8,
    train__ema__start_step=1,
)
LAYOUTS = {"full": {}, "lora": {"train__lora__rank": 4}}


def ema_export(out: Path, lora: bool) -> dict[str, torch.Tensor]:
    export = out / "export"
    return load_file(export / "lora_ema" / LORA_WEIGHTS if lora else export / "transformer_ema" / TRANSFORMER_FILE)


TRANSFORMER_FILE = "diffusion_pytorch_model.safetensors"


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    worst = max(a, key=lambda k: (a[k] - b[k]).abs().max().item())
    assert (a[worst] - b[worst]).abs().max().item() <= ATOL, worst


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_ema_equals_one_process(layout, tiny_wan, shapes_videos, tmp_path):
    lora = layout == "lora"
    overrides = {**COMMON, **LAYOUTS[layout]}
    single = tmp_path / "single"
    train(load_job_config(None, train_overrides(tiny_wan, shapes_videos, single, **overrides)))
    two = tmp_path / "two"
    spindle_train(two, 2, train_overrides(tiny_wan, shapes_videos, two, parallel__dp_shard=2, **overrides))
    assert_close(ema_export(single, lora), ema_export(two, lora))

    # saved sharded: every averaged matrix was written as one piece per rank (no rank gathered it)
    last = ckpt.list_checkpoints(two)[-1]
    metadata = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
    matrices = {k: m for k, m in metadata.items() if k.startswith("ema.") and len(m.size) == 2}
    assert matrices and all(len(m.chunks) == 2 for m in matrices.values()), sorted(matrices)[:3]

    # the dp_shard=2 checkpoint at step 2, resumed on one process: DCP reshards the average too
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed, ignore=shutil.ignore_patterns("export", "step-000004"))
    train(
        load_job_config(None, train_overrides(tiny_wan, shapes_videos, resumed, checkpoint__resume="auto", **overrides))
    )
    assert_close(ema_export(single, lora), ema_export(resumed, lora))
    if lora:
        return  # the other direction once (the same code path for the adapters)
    # and the one-process checkpoint at step 2, resumed on dp_shard=2
    widened = tmp_path / "widened"
    shutil.copytree(single, widened, ignore=shutil.ignore_patterns("export", "step-000004"))
    resume = train_overrides(
        tiny_wan, shapes_videos, widened, parallel__dp_shard=2, checkpoint__resume="auto", **overrides
    )
    spindle_train(widened, 2, resume)
    assert_close(ema_export(single, lora), ema_export(widened, lora))
