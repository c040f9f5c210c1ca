"""The VLM task (spindle.train.tasks.vlm) beyond the conformance suite (tests/conformance/test_vlm_conformance.py,
which runs step-1 parity, packing, the text-only dummy vision forward, train.freeze, export and the 2-process
layouts for every VLM family): Qwen2.5-VL and Qwen3-VL video conversations, activation checkpointing,
refusals before training, and the shipped config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle.api import load_job_config
from spindle.config import ConfigError
from spindle.testing.specs import lm_spec
from spindle.testing.vlm_conformance import grad_norm, stock_model
from tests.conftest import vlm_overrides, vlm_train


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


@pytest.mark.parametrize(("family", "size"), [("qwen2_5_vl", 56), ("qwen3_vl", 64), ("qwen3_vl_moe", 64)])
def test_video_conversation_step1_equals_stock_transformers(family, size, tiny_checkpoint, tmp_path):
    """A LLaVA `<video>` conversation trains on what the stock processor and video processor make of it
    (Qwen2_5_VLProcessor + Qwen2VLVideoProcessor: second_per_grid_ts; Qwen3VLProcessor + Qwen3VLVideoProcessor:
    timestamps in the text; spindle.testing.vlm_conformance.stock_video_inputs, on a clip at the family's patch
    size): step-1 loss (an MoE's with its router aux term) and grad norm of stock `model(input_ids,
    pixel_values_videos, video_grid_thw, [second_per_grid_ts,] mm_token_type_ids, labels)`."""
    import numpy as np

    from spindle.data.media import write_video
    from spindle.testing.vlm_conformance import stock_inputs

    model_path = tiny_checkpoint(family)
    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_video(data / "clip.mp4", rng.integers(0, 255, (12, size, size, 3), dtype=np.uint8), fps=4)
    line = {
        "videos": ["clip.mp4"],
        "conversations": [{"from": "human", "value": "<video>What?"}, {"from": "gpt", "value": "It flickers."}],
    }
    (data / "data.jsonl").write_text(json.dumps(line) + "\n")
    trainer, _ = vlm_train(model_path, data / "data.jsonl", tmp_path / "run", data__packing=False, train__max_steps=1)
    assert trainer.loader.dataset.stats.videos == 1 and trainer.loader.dataset.stats.truncated == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    (inputs,) = stock_inputs(model_path, data / "data.jsonl")  # asserts Spindle's tokens are stock's
    assert inputs["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert ("second_per_grid_ts" in inputs) == (family == "qwen2_5_vl")  # Qwen3-VL: timestamps in the text
    model = stock_model(model_path)
    out = model(**inputs, **lm_spec(family).stock_loss_kwargs)
    out.loss.backward()
    assert logged["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-5)
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
