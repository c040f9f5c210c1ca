"""The VLM task (spindle.train.tasks.vlm) on the tiny Qwen2.5-VL: step-1 loss and grad norm equal stock
transformers, a packed row's loss equals its documents' losses, train.freeze, the text-only dummy vision
forward, and an export that stock transformers loads and generates from.

(Multi-process layouts against one process: tests/distributed/test_vlm_distributed.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from spindle.api import load_job_config, make_trainer
from spindle.config import ConfigError
from tests.conftest import lm_overrides

SEQ = 96  # one conversation of the shared data is at most 80 tokens: nothing is cut


def vlm_overrides(model: Path, data: Path, out: Path, **values) -> list[str]:
    base = dict(data__seq_len=SEQ, data__shuffle=False, train__global_batch_size=1, train__micro_batch_size=1)
    return lm_overrides(model, data, out, **{**base, **values})


def vlm_train(model: Path, data: Path, out: Path, **overrides):
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


def subset(conversations: Path, out: Path, lines: list[int]) -> Path:
    """Some lines of the shared conversations file, media paths made absolute (the fixture is read-only)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = conversations.read_text().splitlines()
    picked = []
    for i in lines:
        obj = json.loads(rows[i])
        for m in obj["messages"]:
            if isinstance(m["content"], list):
                for part in m["content"]:
                    if part["type"] == "image":
                        part["image"] = str(conversations.parent / part["image"])
        picked.append(json.dumps(obj))
    path = out / "data.jsonl"
    path.write_text("\n".join(picked) + "\n")
    return path


@pytest.fixture(params=["qwen2_5_vl", "qwen3_vl"])
def vlm_model(request, tiny_checkpoint) -> Path:
    """Each VLM family's tiny checkpoint."""
    return tiny_checkpoint(request.param)


def stock_inputs(model_path: Path, data: Path) -> list[dict]:
    """Each conversation of `data` as stock transformers takes it: the Qwen2.5-VL processor's input_ids,
    pixel_values, image_grid_thw, mm_token_type_ids (tests/data/test_vlm_data.py proves these equal
    Spindle's), and labels = the assistant tokens (-100 elsewhere; the model shifts them)."""
    from transformers import AutoConfig

    from spindle.data.multimodal import VisionOptions, VisionProcessor, conversation_document
    from spindle.registry import get_family
    from tests.data.test_vlm_data import stock_processor

    stock = stock_processor(model_path)
    config = AutoConfig.from_pretrained(model_path)
    ours = VisionProcessor(
        model_path, stock.tokenizer, config, get_family(config.model_type).rope_index_fn(), VisionOptions()
    )
    out = []
    for line in data.read_text().splitlines():
        obj = json.loads(line)
        doc, _ = conversation_document(obj, data.parent, ours, 4096, "x")
        text = stock.apply_chat_template(obj["messages"], tokenize=False)
        paths = [
            p["image"] for m in obj["messages"] if isinstance(m["content"], list) for p in m["content"] if "image" in p
        ]
        images = [Image.open(data.parent / p).convert("RGB") for p in paths] or None
        inputs = dict(stock(text=[text], images=images, return_tensors="pt"))
        inputs.pop("attention_mask")
        assert inputs["input_ids"][0].tolist() == doc.tokens
        inputs["labels"] = torch.tensor([[t if keep else -100 for t, keep in zip(doc.tokens, doc.learn, strict=True)]])
        out.append(inputs)
    return out


def stock_model(path: Path):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    return model


def grad_norm(model) -> float:
    return float(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    )


def test_step1_loss_and_grad_norm_equal_stock_transformers(vlm_model, vlm_conversations, tmp_path):
    data = subset(vlm_conversations, tmp_path / "data", [0])
    trainer, _ = vlm_train(vlm_model, data, tmp_path / "run", data__packing=False, train__max_steps=1)
    assert trainer.loader.dataset.stats.truncated == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    (inputs,) = stock_inputs(vlm_model, data)
    assert "pixel_values" in inputs
    model = stock_model(vlm_model)
    loss = model(**inputs).loss
    loss.backward()
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


def test_packed_row_loss_equals_the_documents_losses(vlm_model, vlm_conversations, tmp_path):
    """Three conversations (two with an image, one text-only) in one packed row: the summed loss equals
    the sum of stock transformers' per-conversation losses, so neither attention nor 3-D positions cross
    documents."""
    data = subset(vlm_conversations, tmp_path / "data", [0, 3, 1])
    cfg = load_job_config(None, vlm_overrides(vlm_model, data, tmp_path / "run", data__seq_len=256))
    trainer = make_trainer(cfg)
    assert trainer.loader.dataset.stats.rows == 1
    batch = next(trainer.loader)
    assert batch["image_grid_thw"].shape[0] == 2
    packed = trainer.task.forward(trainer.model, batch, 0).loss_sum

    model = stock_model(vlm_model)
    total = torch.zeros(())
    for inputs in stock_inputs(vlm_model, data):
        n = int((inputs["labels"][:, 1:] != -100).sum())
        total = total + model(**inputs).loss * n
    torch.testing.assert_close(packed, total, rtol=1e-5, atol=0)


def test_text_only_batch_runs_the_vision_tower_with_zero_weight(vlm_model, vlm_conversations, tmp_path):
    """A micro-batch with no image still runs the vision tower (what keeps FSDP2's collectives in step across
    ranks): its parameters get a gradient, all zeros, and the loss is stock transformers' text-only loss."""
    data = subset(vlm_conversations, tmp_path / "data", [0, 3])  # line 3 is text-only
    trainer = make_trainer(load_job_config(None, vlm_overrides(vlm_model, data, tmp_path / "run", data__packing=False)))
    next(trainer.loader)
    batch = next(trainer.loader)
    assert "pixel_values" not in batch
    out = trainer.task.forward(trainer.model, batch, 0)
    out.loss_sum.backward()
    vision = [p for n, p in trainer.model.named_parameters() if n.startswith("model.visual.")]
    assert all(p.grad is not None and not p.grad.any() for p in vision)

    inputs = stock_inputs(vlm_model, data)[1]
    n = int((inputs["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(out.loss_sum, stock_model(vlm_model)(**inputs).loss * n, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    ("freeze", "trained"),
    [
        (["vision"], {"aligner", "language"}),
        (["vision", "language"], {"aligner"}),
        (["language"], {"vision", "aligner"}),
    ],
    ids=["vision", "vision+language", "language"],
)
def test_freeze_keeps_parts_unchanged_without_optimizer_state(
    freeze, trained, tiny_qwen2_5_vl, vlm_conversations, tmp_path
):

    from spindle.registry import get_family

    family = get_family("qwen2_5_vl")
    trainer, _ = vlm_train(
        tiny_qwen2_5_vl,
        vlm_conversations,
        tmp_path / "run",
        train__max_steps=2,
        train__global_batch_size=2,
        train__freeze=json.dumps(freeze),
    )
    states = {n for n, p in trainer.model.named_parameters() if p in trainer.optimizer.state}
    assert {family.part_of(n) for n in states} == trained
    before = stock_model(tiny_qwen2_5_vl).state_dict()
    after = stock_model(tmp_path / "run" / "export").state_dict()
    changed = {family.part_of(k) for k in before if not torch.equal(before[k], after[k])}
    assert changed == trained


def test_freezing_every_part_is_refused(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    from spindle.api import check_job_plan

    cfg = load_job_config(
        None,
        vlm_overrides(tiny_qwen2_5_vl, vlm_conversations, tmp_path, train__freeze='["vision","aligner","language"]'),
    )
    with pytest.raises(ConfigError, match="freezes every part"):
        check_job_plan(cfg, 1)
    with pytest.raises(ConfigError, match=r"train\.freeze"):
        load_job_config(None, vlm_overrides(tiny_qwen2_5_vl, vlm_conversations, tmp_path, train__freeze='["eyes"]'))


def test_export_loads_in_stock_transformers_and_generates_from_an_image(
    vlm_model, vlm_conversations, tmp_path, spindle_cli
):
    from safetensors.torch import load_file
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    trainer, _ = vlm_train(vlm_model, vlm_conversations, tmp_path / "run", train__max_steps=2)
    export = tmp_path / "run" / "export"
    written = load_file(export / "model-00001-of-00001.safetensors")
    assert written.keys() == load_file(vlm_model / "model.safetensors").keys()  # the input's key layout
    model = AutoModelForImageTextToText.from_pretrained(export)
    trained = trainer.model.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k

    tok = AutoTokenizer.from_pretrained(export)
    processor = AutoImageProcessor.from_pretrained(export)
    image = Image.open(vlm_conversations.parent / "images" / "image_000.png").convert("RGB")
    pixels = processor(images=[image], return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    n = int(pixels["image_grid_thw"].prod()) // processor.merge_size**2
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), return_tensors="pt")["input_ids"]
    mm_types = (ids == model.config.image_token_id).int()
    out = model.generate(
        input_ids=ids, mm_token_type_ids=mm_types, **pixels, max_new_tokens=5, do_sample=False, min_new_tokens=5
    )
    assert out.shape == (1, ids.shape[1] + 5) and torch.equal(out[:, : ids.shape[1]], ids)

    # `spindle export` of the final checkpoint writes the same folder on one process.
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    again = load_file(tmp_path / "cli" / "model-00001-of-00001.safetensors")
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
    assert (tmp_path / "cli" / "preprocessor_config.json").is_file()


def test_video_conversation_step1_equals_stock_transformers(tiny_qwen2_5_vl, tmp_path):
    """A video conversation (no stock video processor here: Spindle's patches and tokens, the stock model's
    own 3-D positions from mm_token_type_ids and second_per_grid_ts): step-1 loss and grad norm."""
    import numpy as np
    from transformers import AutoConfig, AutoTokenizer

    from spindle.data.media import write_video
    from spindle.data.multimodal import VisionOptions, VisionProcessor, collate_vision, conversation_document
    from spindle.models.shared.vlm_rope import mm_token_types
    from spindle.registry import get_family

    data = tmp_path / "data"
    data.mkdir()
    frames = np.stack([np.full((56, 56, 3), 20 * i, dtype=np.uint8) for i in range(12)])
    write_video(data / "clip.mp4", frames, fps=4)
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "It gets brighter."},
        ]
    }
    (data / "data.jsonl").write_text(json.dumps(line) + "\n")
    vlm_train(tiny_qwen2_5_vl, data / "data.jsonl", tmp_path / "run", data__packing=False, train__max_steps=1)
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    config = AutoConfig.from_pretrained(tiny_qwen2_5_vl)
    processor = VisionProcessor(
        tiny_qwen2_5_vl,
        AutoTokenizer.from_pretrained(tiny_qwen2_5_vl),
        config,
        get_family("qwen2_5_vl").rope_index_fn(),
        VisionOptions(),
    )
    doc, _ = conversation_document(line, data, processor, 4096, "x")
    ids = torch.tensor([doc.tokens])
    labels = torch.tensor([[t if keep else -100 for t, keep in zip(doc.tokens, doc.learn, strict=True)]])
    model = stock_model(tiny_qwen2_5_vl)
    vision = collate_vision(doc.vision)
    assert "pixel_values_videos" in vision
    loss = model(input_ids=ids, mm_token_type_ids=mm_token_types(config, ids), labels=labels, **vision).loss
    loss.backward()
    assert logged["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


def test_gradient_checkpointing_equals_the_plain_run(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    """Activation checkpointing recomputes vision blocks and decoder layers (with the language-model hook):
    the same losses and grad norms as without it."""
    runs = []
    for ac in (False, True):
        out = tmp_path / f"ac_{ac}"
        vlm_train(tiny_qwen2_5_vl, vlm_conversations, out, train__max_steps=2, train__gradient_checkpointing=ac)
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs[1]] == pytest.approx([m[key] for m in runs[0]], rel=1e-5), key


def test_cli_names_the_bad_line_before_training(tiny_qwen2_5_vl, tmp_path, spindle_cli):
    data = tmp_path / "data.jsonl"
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "gone.png"}]},
            {"role": "assistant", "content": "A square."},
        ]
    }
    data.write_text(json.dumps(line) + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    r = spindle_cli("train", cfg, *vlm_overrides(tiny_qwen2_5_vl, data, tmp_path / "o"))
    assert r.returncode == 2
    assert f"{data}:1: image" in r.stderr and "gone.png not found" in r.stderr and "Traceback" not in r.stderr


def test_shipped_vlm_config_is_a_valid_vlm_job():
    from spindle.config import VLMJobConfig, load_raw, validate_config

    cfg = validate_config(load_raw(Path(__file__).parents[2] / "configs" / "qwen2_5_vl_7b.yaml"), VLMJobConfig)
    assert cfg.data.packing and cfg.train.freeze == ["vision"]
