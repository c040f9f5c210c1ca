"""Gemma 3 image-text models (the gemma3_vl family) beyond the VLM conformance suite: the registry tells them from
the text models by model_type; an image's soft tokens attend to each other both ways in training as in stock
transformers (the step loss equals stock's with `token_type_ids`, and differs from the causal one); pan-and-scan,
videos and pixel budgets are refused naming the key; packed rows train as the same conversations unpacked (each
document's image block bidirectional); Ulysses SP equals one process with an image block cut by the sequence
split (slow)."""

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


def test_packed_rows_train_as_the_conversations_unpacked(tiny_checkpoint, vlm_conversations, tmp_path):
    """One step over three conversations (image, text-only, image): packed into one row, or one row each, the
    same step loss and grad norm. The second image's block sits in a later document, where transformers' own
    packed sliding-window mask would look its block up at in-document positions (spindle.ops.packed_block_masks)."""
    from spindle.train.metrics import read_metrics

    model = tiny_checkpoint("gemma3_vl")
    data = suite.subset(vlm_conversations, tmp_path / "data", [0, 3, 1])
    common = dict(train__max_steps=1, train__global_batch_size=1, checkpoint__export=False)
    packed, rows = tmp_path / "packed", tmp_path / "rows"
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, packed, data__seq_len=256, **common)))
    assert trainer.loader.dataset.stats.rows == 1  # packing resolved on: the three conversations in one row
    trainer.run()
    unpacked = {**common, "train__global_batch_size": 3, "data__packing": False}
    make_trainer(load_job_config(None, vlm_overrides(model, data, rows, **unpacked))).run()
    got, want = read_metrics(packed)[0], read_metrics(rows)[0]
    for key in ("loss", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key


# A conversation whose image's soft tokens sit at row positions 31-34 (asserted): with rows of 64 tokens, Ulysses
# SP over 2 ranks cuts its block between them (rank 0 holds 0-31, rank 1 32-63).
SPLIT_PROMPT = "Look closely at this small picture of one shape, then answer. "
SPLIT_SEQ = 64


def split_image_conversations(vlm_conversations, out):
    """Two conversations: one with an image after SPLIT_PROMPT, and a text-only one of the shared data."""
    lines = vlm_conversations.read_text().splitlines()
    image = str(vlm_conversations.parent / "images" / "image_000.png")
    content = [{"type": "text", "text": SPLIT_PROMPT}, {"type": "image", "image": image}]
    content.append({"type": "text", "text": "What colour is the shape?"})
    split = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "A pink triangle."}]}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "data.jsonl"
    path.write_text(json.dumps(split) + "\n" + lines[3] + "\n")
    return path


@pytest.mark.slow
def test_sequence_parallel_with_an_image_block_cut_by_the_split_equals_one_process(
    tiny_checkpoint, vlm_conversations, tmp_path
):
    """parallel.sp=2: each rank's attention sees the whole row's image block (causal OR same block, windowed on
    the sliding layers) although the split cuts it, so the steps' losses, grad norms and exported weights are
    one process's; a text-only step runs too."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import check_same_run
    from tests.conftest import spindle_train

    model = tiny_checkpoint("gemma3_vl")
    data = split_image_conversations(vlm_conversations, tmp_path / "data")
    run = dict(data__seq_len=SPLIT_SEQ, data__packing=False, train__max_steps=2, checkpoint__export=True)
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "probe", **run)))
    ids = next(trainer.loader)["input_ids"][0]
    soft = (ids == trainer.task.model_config().image_token_id).nonzero().flatten().tolist()
    assert soft[0] < SPLIT_SEQ // 2 <= soft[-1], soft  # the block straddles the ranks' chunks
    one, two = tmp_path / "one", tmp_path / "two"
    spindle_train(one, 1, vlm_overrides(model, data, one, **run))
    spindle_train(two, 2, vlm_overrides(model, data, two, **run, parallel__sp=2, parallel__dp_shard=1))
    check_same_run(get_family("gemma3_vl"), one, two)


def test_cli_tiny_model_trains_with_default_flags_and_the_export_loads(vlm_conversations, tmp_path, spindle_cli):
    """`spindle tiny-model gemma3_vl` then `spindle train` with only the model, the data, the output folder and
    a step count: the family is detected from config.json, conversations are packed (packing resolved on: each
    document's image blocks keep their own mask), and the export loads in stock AutoModelForImageTextToText."""
    from transformers import AutoModelForImageTextToText

    model = tmp_path / "tiny"
    assert spindle_cli("tiny-model", "gemma3_vl", model).returncode == 0
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}\n")
    out = tmp_path / "run"
    args = [f"model.path={model}", f"data.path={vlm_conversations}", f"train.output_dir={out}", "train.max_steps=2"]
    r = spindle_cli("train", cfg, *args)
    assert r.returncode == 0, r.stderr
    assert "run: gemma3_vl (vlm task)" in r.stdout and "data: documents 8, rows 1," in r.stdout  # packed
    assert json.loads((out / "run.json").read_text())["identity"]["data.packing"] is True  # recorded as resolved
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
