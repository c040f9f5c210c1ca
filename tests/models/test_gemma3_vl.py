"""Gemma 3 image-text models (the gemma3_vl family) beyond the VLM conformance suite: the registry tells them from
the text models by model_type; an image's soft tokens attend to each other both ways in training as in stock
transformers (the step loss equals stock's with `token_type_ids`, and differs from the causal one); pan-and-scan,
videos and pixel budgets are refused naming the key; Ulysses SP is refused before launch, naming why (no
bidirectional image blocks in Spindle's Ulysses attention)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spindle.api import load_job_config, make_trainer
from spindle.testing import vlm_conformance as suite
from tests.conftest import vlm_overrides


def test_the_registry_serves_image_text_and_text_checkpoints_apart(tiny_checkpoint):
    from spindle.registry import family_of, resolve_family

    vlm, text = tiny_checkpoint("gemma3_vl"), tiny_checkpoint("gemma3")
    assert resolve_family(vlm).name == "gemma3_vl" and resolve_family(text).name == "gemma3"
    with pytest.raises(ValueError, match=r"model.family=gemma3 serves transformers model_type gemma3_text"):
        family_of(vlm, "gemma3")


def test_tiny_tokenizer_has_gemmas_image_tokens_and_template(tiny_checkpoint):
    """The chat template renders an image part as <start_of_image> (the assistant is "model", a system message
    folds into the first user turn), which stock Gemma3Processor expands to the image's soft tokens."""
    from PIL import Image

    stock = suite.stock_processor(tiny_checkpoint("gemma3_vl"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A dot."},
    ]
    text = stock.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\n<start_of_image>What?<end_of_turn>\n<start_of_turn>model\nA dot."
        "<end_of_turn>\n"
    )
    ids = stock(text=[text], images=[Image.new("RGB", (40, 30))], add_special_tokens=False)["input_ids"][0]
    expanded = stock.tokenizer.decode(ids)
    assert "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n" in expanded


def test_image_tokens_attend_to_each_other_both_ways(tiny_checkpoint, vlm_conversations, tmp_path):
    """Spindle's rows carry 1-D positions and no patch grid, and its loss is stock transformers' with the
    processor's `token_type_ids` (each image's soft tokens one bidirectional block), which is not the causal
    loss: the check would fail if the mask were left causal."""
    model = tiny_checkpoint("gemma3_vl")
    data = suite.subset(vlm_conversations, tmp_path / "data", [0])
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "run", data__packing=False)))
    batch = next(trainer.loader)
    assert batch["position_ids"].shape == batch["input_ids"].shape and "image_grid_thw" not in batch
    assert batch["pixel_values"].shape == (1, 3, 32, 32)
    loss = trainer.task.forward(trainer.model, batch, 0).loss_sum

    (inputs,) = suite.stock_inputs(model, data)
    assert int(inputs["token_type_ids"].sum()) == 4  # mm_tokens_per_image soft tokens
    stock = suite.stock_model(model)
    expected = suite.stock_token_loss_sum(stock, inputs)
    causal = suite.stock_token_loss_sum(stock, {k: v for k, v in inputs.items() if k != "token_type_ids"})
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
    assert abs(float(expected - causal)) > 10 * 1e-5 * abs(float(expected))  # ten times the tolerance above


def test_pan_and_scan_videos_and_pixel_budgets_are_refused_naming_the_key(tiny_checkpoint, vlm_conversations, tmp_path):
    from spindle.data.text import TextDataError

    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("gemma3_vl"), model)
    data = suite.subset(vlm_conversations, tmp_path / "data", [0])

    def trainer(model_path, data_path, name, **values):
        return make_trainer(load_job_config(None, vlm_overrides(model_path, data_path, tmp_path / name, **values)))

    with pytest.raises(ValueError, match=r"data\.max_pixels: Gemma 3 resizes every image to its tower's fixed size"):
        trainer(model, data, "pixels", data__max_pixels=4096)
    video = tmp_path / "video.jsonl"
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A ball."},
        ]
    }
    video.write_text(json.dumps(line) + "\n")
    with pytest.raises(TextDataError, match=r"video\.jsonl:1: video clip\.mp4: gemma3 models take no video"):
        trainer(model, video, "video")
    config = json.loads((model / "preprocessor_config.json").read_text())
    (model / "preprocessor_config.json").write_text(json.dumps({**config, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: do_pan_and_scan is on"):
        trainer(model, data, "pan")


def test_sequence_parallel_is_refused_before_launch(tiny_checkpoint, vlm_conversations, tmp_path, spindle_cli):
    data = suite.subset(vlm_conversations, tmp_path / "data", [0])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    args = [f"model.path={tiny_checkpoint('gemma3_vl')}", f"data.path={data}", f"train.output_dir={tmp_path / 'run'}"]
    result = spindle_cli("train", cfg, *args, "parallel.sp=2", "--nproc", "2")
    assert result.returncode != 0
    assert "attend to each other both ways" in result.stderr and "parallel.sp: 1" in result.stderr


def test_cli_tiny_model_trains_with_default_flags_and_the_export_loads(vlm_conversations, tmp_path, spindle_cli):
    """`spindle tiny-model gemma3_vl` then `spindle train` with only the model, the data, the output folder and
    a step count: the family is detected from config.json, conversations are one per row (packing resolved off),
    and the export loads in stock AutoModelForImageTextToText."""
    from transformers import AutoModelForImageTextToText

    model = tmp_path / "tiny"
    assert spindle_cli("tiny-model", "gemma3_vl", model).returncode == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    out = tmp_path / "run"
    args = [f"model.path={model}", f"data.path={vlm_conversations}", f"train.output_dir={out}", "train.max_steps=2"]
    r = spindle_cli("train", cfg, *args)
    assert r.returncode == 0, r.stderr
    assert "run: gemma3_vl (vlm task)" in r.stdout and "data: documents 8, rows 8," in r.stdout  # one per row
    assert json.loads((out / "run.json").read_text())["identity"]["data.packing"] is False  # recorded as resolved
    exported = AutoModelForImageTextToText.from_pretrained(out / "export")
    assert type(exported).__name__ == "Gemma3ForConditionalGeneration"


def test_lora_on_the_projector_is_refused_naming_it(tiny_checkpoint, vlm_conversations, tmp_path):
    """The projector (part `aligner`) is a weight matrix and a norm, no linear layer: LoRA on it names the part."""
    from spindle.config import ConfigError

    data = suite.subset(vlm_conversations, tmp_path / "data", [0])
    lora = json.dumps({"rank": 4, "alpha": 8, "parts": ["language", "aligner"]})
    overrides = vlm_overrides(tiny_checkpoint("gemma3_vl"), data, tmp_path / "run", train__lora=lora)
    with pytest.raises(ConfigError, match="aligner"):
        make_trainer(load_job_config(None, overrides))


@pytest.mark.parametrize(
    ("freeze", "trained"), [(["language"], {"vision", "aligner"}), (["vision", "language"], {"aligner"})]
)
def test_freezing_leaves_the_other_parts_training(freeze, trained, tiny_checkpoint, vlm_conversations, tmp_path):
    """The suite freezes the SigLIP tower (its case for this family); here the decoder, and all but the
    projector: only the parts left out train and hold optimizer state."""
    from spindle.registry import get_family
    from tests.conftest import vlm_train

    model = tiny_checkpoint("gemma3_vl")
    trainer, _ = vlm_train(model, vlm_conversations, tmp_path / "run", **suite.freeze_overrides(freeze))
    before, after = (suite.stock_model(path).state_dict() for path in (model, tmp_path / "run" / "export"))
    suite.check_frozen_parts(get_family("gemma3_vl"), trainer, before, after, trained)
