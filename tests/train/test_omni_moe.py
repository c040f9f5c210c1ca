"""The omni MoE task (spindle.train.tasks.omni_moe) on the tiny Qwen3-Omni-MoE, what the conformance suite
(tests/conformance/test_omni_conformance.py: step 1 against the stock thinker with the router aux loss, the
export in the input's per-expert layout, ep=2 and sp=2 against one process) does not check: train.freeze over
the audio encoder and the experts, videos with and without their audio track, LoRA on the attention and on the
fused experts, and fused expert checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.registry import get_family
from spindle.testing import omni_conformance as suite
from spindle.testing.vlm_conformance import check_frozen_parts, check_stock_step, freeze_overrides, subset
from tests.conftest import omni_train
from tests.train.test_omni import video_step

FAMILY = get_family("qwen3_omni_moe")


def test_freeze_audio_and_language_trains_only_vision_and_aligners(tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    """`train.freeze: [audio, language]` (the experts are language): the frozen parts have no optimizer state and
    come out of the export as they went in; the vision tower and the aligners (merger, deepstack mergers, the
    audio encoder's output projections) are trained."""
    freeze = freeze_overrides(["audio", "language"])
    trainer, _ = omni_train(tiny_qwen3_omni_moe, omni_conversations, tmp_path / "run", **freeze)
    before, after = (
        suite.stock_full_model(FAMILY, path).thinker.state_dict()
        for path in (tiny_qwen3_omni_moe, tmp_path / "run" / "export")
    )
    check_frozen_parts(FAMILY, trainer, before, after, {"vision", "aligner"})


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "use_audio_in_video"])
def test_video_step1_equals_the_stock_thinker(with_audio, tiny_qwen3_omni_moe, tmp_path):
    """A video conversation, without and with its audio track (`data.use_audio_in_video`: the track's tokens
    interleaved with the frames' by time): step 1's loss (aux term included) and grad norm equal the stock
    thinker given Spindle's tokens, frames and track features, computing its own 3-D positions from the grid,
    the seconds per grid and (with audio) the track's length. (The stock video processor needs torchvision, so
    the frames are Spindle's on both sides.)"""
    trainer, logged, inputs = video_step(tiny_qwen3_omni_moe, tmp_path, use_audio_in_video=with_audio)
    assert "pixel_values_videos" in inputs and ("input_features" in inputs) == with_audio
    ids, config = inputs["input_ids"], trainer.model.config
    if with_audio:  # the frames' and the track's tokens interleave inside <|audio_start|> ... <|audio_end|>
        first_audio = int((ids == config.audio_token_id).nonzero()[0, 1])
        last_video = int((ids == config.video_token_id).nonzero()[-1, 1])
        assert first_audio < last_video and int((ids == config.audio_start_token_id).sum()) == 1
    check_stock_step(FAMILY, suite.stock_thinker(FAMILY, tiny_qwen3_omni_moe), inputs, logged)


def test_lora_adapts_the_decoder_attention_and_exports_adapters(tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    """LoRA on the MoE thinker: by default adapters on the decoder's attention projections only (the fused
    experts are opt-in through train.lora.targets), exported as a PEFT folder; the loss still carries the
    router aux term."""
    from safetensors.torch import load_file

    trainer, _ = omni_train(
        tiny_qwen3_omni_moe, omni_conversations, tmp_path / "run", train__max_steps=2, train__lora='{"rank": 4}'
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n and ".self_attn." in n for n in trainable)
    assert all(n.startswith("model.language_model.") for n in trainable)
    adapters = load_file(tmp_path / "run" / "export" / "lora" / "adapter_model.safetensors")
    assert adapters and not any("experts" in k for k in adapters)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["aux_loss"] > 0 for m in logged if "aux_loss" in m) and any("aux_loss" in m for m in logged)


@pytest.mark.parametrize("transposed", [False, True], ids=["fused", "fused_transposed"])
def test_fused_expert_checkpoint_trains_alike_and_exports_fused(
    transposed, tiny_qwen3_omni_moe, omni_conversations, tmp_path
):
    """The tiny folder rewritten with the thinker's experts fused (`gate_up_proj [E, 2I, H]`, or transposed
    `[E, H, 2I]` as Qwen3-VL-MoE's releases store them): the same first-step loss as the per-expert folder, and
    an export that keeps the fused layout, whose experts are the trained model's."""
    import shutil

    from safetensors.torch import load_file, save_file

    from spindle.models.shared.moe_checkpoints import FUSED, FUSED_TRANSPOSED

    fused = tmp_path / "fused"
    shutil.copytree(tiny_qwen3_omni_moe, fused)
    tensors = load_file(fused / "model.safetensors")
    for layer in range(2):
        prefix = f"thinker.model.layers.{layer}.mlp.experts"
        gate = [tensors.pop(f"{prefix}.{j}.gate_proj.weight") for j in range(8)]
        up = [tensors.pop(f"{prefix}.{j}.up_proj.weight") for j in range(8)]
        down = torch.stack([tensors.pop(f"{prefix}.{j}.down_proj.weight") for j in range(8)])
        gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        if transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        tensors[f"{prefix}.gate_up_proj"], tensors[f"{prefix}.down_proj"] = gate_up.contiguous(), down.contiguous()
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    assert FAMILY.adapter().layout(fused) == (FUSED_TRANSPOSED if transposed else FUSED)

    data = subset(omni_conversations, tmp_path / "data", [0, 2])
    runs = {}
    for name, model in (("per_expert", tiny_qwen3_omni_moe), ("fused", fused)):
        trainer, _ = omni_train(model, data, tmp_path / name, train__max_steps=1, train__global_batch_size=2)
        runs[name] = (trainer, json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]))
    assert runs["fused"][1]["loss"] == pytest.approx(runs["per_expert"][1]["loss"], rel=1e-6)

    index = json.loads((tmp_path / "fused" / "export" / "model.safetensors.index.json").read_text())["weight_map"]
    key = "thinker.model.layers.1.mlp.experts.gate_up_proj"
    assert key in index and not any(".experts.0." in k for k in index if k.startswith("thinker."))
    stored = load_file(tmp_path / "fused" / "export" / index[key])[key]
    trained = runs["fused"][0].model.state_dict()["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(stored.transpose(1, 2) if transposed else stored, trained)


def test_lora_on_the_thinker_experts_loads_in_stock_peft(tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    """`train.lora.targets: [experts]` on the thinker's fused experts (the implementation Qwen3-MoE uses):
    only the expert adapters train, and stock PEFT loads the exported folder onto the stock thinker with the
    trained thinker's logits on an audio conversation (1e-5)."""

    data = subset(omni_conversations, tmp_path / "data", [0])
    lora = '{"rank": 4, "alpha": 8, "targets": ["experts"]}'
    trainer, _ = omni_train(
        tiny_qwen3_omni_moe, data, tmp_path / "run", train__max_steps=2, train__lr=1e-2, train__lora=lora
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and ".mlp.experts." in n for n in trainable)
    suite.check_thinker_peft_export(FAMILY, tiny_qwen3_omni_moe, data, trainer, tmp_path / "run" / "export" / "lora")
