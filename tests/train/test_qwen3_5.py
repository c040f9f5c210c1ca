"""Qwen3.5 (`qwen3_5`): what its Gated DeltaNet layers change for training. The rest is the VLM conformance
suite's (tests/conformance/test_vlm_conformance.py: step 1 = stock on an image conversation, packing refused,
dp_shard=2 = one process)."""

from __future__ import annotations

import pytest

from spindle.config import ConfigError
from spindle.distributed.mesh import ParallelDims
from spindle.registry import get_family
from spindle.train.tasks.vlm import VLMTask
from tests.conftest import load_job_config, vlm_overrides


def test_sequence_parallel_is_refused_before_launch_naming_the_linear_attention(
    tiny_checkpoint, vlm_conversations, tmp_path
):
    model = tiny_checkpoint("qwen3_5")
    cfg = load_job_config(None, vlm_overrides(model, vlm_conversations, tmp_path / "run"))
    VLMTask.check_plan(cfg, get_family("qwen3_5"), ParallelDims(dp_shard=2).resolve(2))  # FSDP2: fine
    with pytest.raises(ConfigError, match=r"parallel\.sp=2: qwen3_5 models have linear-attention"):
        VLMTask.check_plan(cfg, get_family("qwen3_5"), ParallelDims(sp=2).resolve(2))
    assert VLMTask.packs(cfg) is False  # data.packing unset: one conversation per row
