"""The omni MoE task (spindle.train.tasks.omni_moe) on the tiny Qwen3-Omni-MoE: step-1 loss (router aux loss
included) and grad norm equal the stock thinker on the stock processor's inputs, and an export in the input's
per-expert layout that the stock full model loads and generates a text reply to an audio clip with, its talker
and code2wav tensors byte-identical to the input.

(`parallel.ep=2` against one process: tests/distributed/test_omni_distributed.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

from spindle.testing.vlm_conformance import check_frozen_parts, freeze_overrides, subset
from tests.train.test_omni import first_step, omni_train, stock_inputs, unshifted, untrained_bytes, video_step
from tests.train.test_omni import stock_thinker as omni_stock_thinker
from tests.train.test_vlm import grad_norm

UNTRAINED = ("talker.", "code2wav.")
# stock_inputs' family and processor for Qwen3-Omni-MoE
QWEN3_STOCK = dict(family_name="qwen3_omni_moe", processor_class=Qwen3OmniMoeProcessor)


def qwen3_stock_inputs(model: Path, data: Path) -> list[dict]:
    return stock_inputs(model, data, **QWEN3_STOCK)


def stock_thinker(path: Path):
    return omni_stock_thinker(path, "Qwen3OmniMoeThinkerForConditionalGeneration")


@pytest.mark.parametrize("line", [0, 2], ids=["audio", "image_then_audio"])
def test_step1_loss_and_grad_norm_equal_the_stock_thinker(line, tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    logged, inputs = first_step(tiny_qwen3_omni_moe, omni_conversations, tmp_path, line, **QWEN3_STOCK)
    model = stock_thinker(tiny_qwen3_omni_moe)
    out = model(**inputs, output_router_logits=True)  # stock: token loss + router_aux_loss_coef x aux loss
    out.loss.backward()
    assert logged["aux_loss"] == pytest.approx(float(out.aux_loss.detach()), rel=1e-5)
    assert logged["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


def test_export_keeps_the_expert_layout_and_the_untrained_tensors(
    tiny_qwen3_omni_moe, omni_conversations, tmp_path, spindle_cli
):
    """Two steps on the four conversations, exported: the thinker's experts per expert as the input had them,
    the talker and code2wav byte-identical, the processor file as it came; the stock full model loads the
    folder, its thinker holds the trained weights and answers an audio clip; `spindle export` of the
    checkpoint writes the same."""
    from safetensors import safe_open
    from transformers import Qwen3OmniMoeForConditionalGeneration

    trainer, _ = omni_train(tiny_qwen3_omni_moe, omni_conversations, tmp_path / "run", train__max_steps=2)
    export = tmp_path / "run" / "export"
    before = untrained_bytes(tiny_qwen3_omni_moe, UNTRAINED)
    assert before and untrained_bytes(export, UNTRAINED) == before
    assert (export / "preprocessor_config.json").read_bytes() == (
        tiny_qwen3_omni_moe / "preprocessor_config.json"
    ).read_bytes()
    index = json.loads((export / "model.safetensors.index.json").read_text())["weight_map"]
    assert "thinker.model.layers.0.mlp.experts.7.down_proj.weight" in index
    assert not any(k.endswith("experts.gate_up_proj") for k in index)

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        export, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trained = trainer.model.state_dict()
    thinker = model.thinker.state_dict()
    assert thinker.keys() == trained.keys()
    for k, v in thinker.items():
        assert torch.equal(v, trained[k]), k
    base = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_qwen3_omni_moe, dtype=torch.float32)
    changed = [k for k, v in base.thinker.state_dict().items() if not torch.equal(v, thinker[k])]
    assert any("experts" in k for k in changed)  # the experts were trained and written back
    with safe_open(str(export / index["thinker.lm_head.weight"]), "pt") as f:
        assert f.get_tensor("thinker.lm_head.weight").dtype == torch.float32

    # the exported thinker answers an audio clip: the stock processor's prompt, greedy text generation
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    from spindle.data.audio import decode_audio
    from tests.data.test_omni_data import lines, stock_processor

    stock = stock_processor(export, Qwen3OmniMoeProcessor)
    user = lines(omni_conversations)[0]["messages"][0]  # an audio part and a question
    prompt = stock.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    clip = decode_audio(omni_conversations.parent / user["content"][0]["audio"], 16000)
    inputs = dict(stock(text=[prompt], audio=[clip], return_tensors="pt"))
    out = model.generate(
        **inputs,
        generation_mode="text",
        thinker_eos_token_id=stock.tokenizer.eos_token_id,
        thinker_max_new_tokens=5,
        thinker_min_new_tokens=5,
        thinker_do_sample=False,
    )
    ids = inputs["input_ids"]
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[:, : ids.shape[1]], ids)
    assert isinstance(stock.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)[0], str)

    # `spindle export` of the final checkpoint writes the same folder on one process.
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    assert untrained_bytes(tmp_path / "cli", UNTRAINED) == before
    assert (
        json.loads((tmp_path / "cli" / "model.safetensors.index.json").read_text())["weight_map"].keys() == index.keys()
    )
    again = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tmp_path / "cli", dtype=torch.float32)
    assert all(torch.equal(v, thinker[k]) for k, v in again.thinker.state_dict().items())


def test_freeze_audio_and_language_trains_only_vision_and_aligners(tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    """`train.freeze: [audio, language]` (the experts are language): the frozen parts have no optimizer state and
    come out of the export as they went in; the vision tower and the aligners (merger, deepstack mergers, the
    audio encoder's output projections) are trained."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from spindle.registry import get_family

    family = get_family("qwen3_omni_moe")
    freeze = freeze_overrides(["audio", "language"])
    trainer, _ = omni_train(tiny_qwen3_omni_moe, omni_conversations, tmp_path / "run", **freeze)
    load = Qwen3OmniMoeForConditionalGeneration.from_pretrained
    before, after = (
        load(path, dtype=torch.float32).thinker.state_dict()
        for path in (tiny_qwen3_omni_moe, tmp_path / "run" / "export")
    )
    check_frozen_parts(family, trainer, before, after, {"vision", "aligner"})


@pytest.mark.parametrize("with_audio", [False, True], ids=["frames", "use_audio_in_video"])
def test_video_step1_equals_the_stock_thinker(with_audio, tiny_qwen3_omni_moe, tmp_path):
    """A video conversation, without and with its audio track (`data.use_audio_in_video`: the track's tokens
    interleaved with the frames' by time): step 1's loss (aux term included) and grad norm equal the stock
    thinker given Spindle's tokens, frames and track features, computing its own 3-D positions from the grid,
    the seconds per grid and (with audio) the track's length. (The stock video processor needs torchvision, so
    the frames are Spindle's on both sides.)"""
    trainer, logged, batch, inputs = video_step(tiny_qwen3_omni_moe, tmp_path, use_audio_in_video=with_audio)
    assert "pixel_values_videos" in inputs and ("input_features" in inputs) == with_audio
    ids = batch["input_ids"]
    config = trainer.model.config
    if with_audio:  # the frames' and the track's tokens interleave inside <|audio_start|> ... <|audio_end|>
        first_audio = int((ids == config.audio_token_id).nonzero()[0])
        last_video = int((ids == config.video_token_id).nonzero()[-1])
        assert first_audio < last_video and int((ids == config.audio_start_token_id).sum()) == 1
    model = stock_thinker(tiny_qwen3_omni_moe)
    out = model(
        input_ids=ids[None],
        attention_mask=batch["attention_mask"][None],
        labels=unshifted(batch["shift_labels"]),
        video_second_per_grid=inputs.pop("second_per_grid_ts"),
        use_audio_in_video=with_audio,
        output_router_logits=True,
        **inputs,
    )
    out.loss.backward()
    assert logged["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


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
    from spindle.registry import get_family

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
    assert get_family("qwen3_omni_moe").adapter().layout(fused) == (FUSED_TRANSPOSED if transposed else FUSED)

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
    from peft import PeftModel

    data = subset(omni_conversations, tmp_path / "data", [0])
    lora = '{"rank": 4, "alpha": 8, "targets": ["experts"]}'
    trainer, _ = omni_train(
        tiny_qwen3_omni_moe, data, tmp_path / "run", train__max_steps=2, train__lr=1e-2, train__lora=lora
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and ".mlp.experts." in n for n in trainable)
    (inputs,) = qwen3_stock_inputs(tiny_qwen3_omni_moe, data)
    inputs.pop("labels")
    with torch.no_grad():
        ours = trainer.model.eval()(**inputs).logits
        base = stock_thinker(tiny_qwen3_omni_moe).eval()
        assert (ours - base(**inputs).logits).abs().max() > 1e-4  # the adapters changed the thinker
        peft = PeftModel.from_pretrained(base, tmp_path / "run" / "export" / "lora").eval()
        torch.testing.assert_close(peft(**inputs).logits, ours, rtol=0, atol=1e-5)
