"""Qwen3.5 (`qwen3_5`): what its Gated DeltaNet layers change for training. The rest is the VLM conformance
suite's (tests/conformance/test_vlm_conformance.py: step 1 = stock on an image conversation, packing refused,
dp_shard=2 and sp=2 = one process; tests/distributed/test_ulysses_attention.py: a Gated DeltaNet layer under
Ulysses with its key heads repeated)."""

from __future__ import annotations

import pytest

from spindle.config import ConfigError
from spindle.distributed.mesh import ParallelDims
from spindle.registry import get_family
from spindle.train.tasks.vlm import VLMTask
from tests.conftest import load_job_config, vlm_overrides


def test_sequence_parallel_checks_the_linear_heads_before_launch(tiny_checkpoint, vlm_conversations, tmp_path):
    model = tiny_checkpoint("qwen3_5")  # 4 value heads, 2 key heads in its Gated DeltaNet layers
    cfg = load_job_config(None, vlm_overrides(model, vlm_conversations, tmp_path / "run"))
    VLMTask.check_plan(cfg, get_family("qwen3_5"), ParallelDims(dp_shard=2).resolve(2))  # FSDP2: fine
    VLMTask.check_plan(cfg, get_family("qwen3_5"), ParallelDims(sp=2).resolve(2))  # Ulysses: heads split
    with pytest.raises(ConfigError, match=r"(num_attention_heads|linear_num_value_heads).*not divisible by parallel"):
        VLMTask.check_plan(cfg, get_family("qwen3_5"), ParallelDims(sp=8).resolve(8))
    assert VLMTask.packs(cfg) is False  # data.packing unset: one conversation per row


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_lora_on_the_hybrid_decoder_and_the_tower_loads_in_stock_peft(
    name, tiny_checkpoint, vlm_conversations, tmp_path
):
    """Adapters on the vision blocks and on both kinds of decoder layer (the Gated DeltaNet projections and the
    full-attention ones): stock PEFT loads the folder and stock transformers the merged
    one with the trained logits (tests/train/test_lm_lora.py: check_vlm_lora_export)."""
    from tests.train.test_lm_lora import check_vlm_lora_export
    from tests.train.test_vlm_lora import lora

    adapted = check_vlm_lora_export(
        tiny_checkpoint(name), vlm_conversations, tmp_path, lora(["language", "vision"]), parts={"language", "vision"}
    )
    assert any(".linear_attn.in_proj_qkv." in n for n in adapted)  # a Gated DeltaNet layer
    assert any(".self_attn.q_proj." in n for n in adapted)  # the full-attention layer
