"""The omni task (spindle.train.tasks.omni) on the tiny Qwen2.5-Omni, what the conformance suite
(tests/conformance/test_omni_conformance.py: step 1 against the stock thinker, the export, the 2-process
layouts) does not check: a packed row's loss equals its conversations' losses, an audio-free batch runs the
audio encoder with weight zero, train.freeze over the audio encoder, LoRA, videos with their audio track, the
talker never read for training, gradient checkpointing and the whole-model load path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from spindle.api import load_job_config, make_trainer
from spindle.registry import get_family
from spindle.testing import omni_conformance as suite
from spindle.testing.vlm_conformance import check_frozen_parts, check_stock_step, freeze_overrides, subset
from tests.conftest import omni_overrides, omni_train, vlm_overrides

FAMILY = get_family("qwen2_5_omni")


def test_packed_row_loss_equals_the_conversations_losses(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """The four conversations (audio, image, image + audio, image) in one packed row: the summed loss equals the
    sum of the stock thinker's per-conversation losses (neither attention nor positions cross conversations,
    and the clips' features go to their own tokens)."""
    data = subset(omni_conversations, tmp_path / "data", [0, 1, 2, 3])
    trainer = make_trainer(
        load_job_config(None, omni_overrides(tiny_qwen2_5_omni, data, tmp_path / "run", data__seq_len=384))
    )
    assert trainer.loader.dataset.stats.rows == 1
    batch = next(trainer.loader)
    assert batch["input_features"].shape[0] == 2 and batch["image_grid_thw"].shape[0] == 3
    packed = trainer.task.forward(trainer.model, batch, 0).loss_sum

    model = suite.stock_thinker(FAMILY, tiny_qwen2_5_omni)
    total = torch.zeros(())
    for inputs in suite.stock_inputs(tiny_qwen2_5_omni, data, FAMILY):
        n = int((inputs["labels"][:, 1:] != -100).sum())
        total = total + model(**inputs).loss * n
    torch.testing.assert_close(packed, total, rtol=1e-5, atol=0)


def test_audio_free_batch_runs_the_audio_encoder_with_zero_weight(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """A micro-batch without audio still runs the audio encoder (what keeps FSDP2's collectives in step across
    ranks): every parameter its forward uses gets a gradient, all zeros, and the loss is the stock loss."""
    data = subset(omni_conversations, tmp_path / "data", [0, 1])  # line 1: an image, no audio
    trainer = make_trainer(
        load_job_config(None, omni_overrides(tiny_qwen2_5_omni, data, tmp_path / "run", data__packing=False))
    )
    next(trainer.loader)
    batch = next(trainer.loader)
    assert "input_features" not in batch and "pixel_values" in batch
    out = trainer.task.forward(trainer.model, batch, 0)
    out.loss_sum.backward()
    audio = {n: p for n, p in trainer.model.named_parameters() if n.startswith("model.audio_tower.")}
    # audio_bos_eos_token is a parameter the stock forward never uses (no gradient in stock either)
    used = {n: p for n, p in audio.items() if "audio_bos_eos_token" not in n}
    assert used and all(p.grad is not None and not p.grad.any() for p in used.values())

    inputs = suite.stock_inputs(tiny_qwen2_5_omni, data, FAMILY)[1]
    n = int((inputs["labels"][:, 1:] != -100).sum())
    torch.testing.assert_close(
        out.loss_sum, suite.stock_thinker(FAMILY, tiny_qwen2_5_omni)(**inputs).loss * n, rtol=1e-5, atol=0
    )


@pytest.mark.parametrize(
    ("freeze", "trained"),
    [(["audio"], {"vision", "aligner", "language"}), (["audio", "vision", "language"], {"aligner"})],
    ids=["audio", "all_but_aligners"],
)
def test_freeze_keeps_parts_unchanged_without_optimizer_state(
    freeze, trained, tiny_qwen2_5_omni, omni_conversations, tmp_path
):
    trainer, _ = omni_train(tiny_qwen2_5_omni, omni_conversations, tmp_path / "run", **freeze_overrides(freeze))
    before, after = (
        suite.stock_thinker(FAMILY, path).state_dict() for path in (tiny_qwen2_5_omni, tmp_path / "run" / "export")
    )
    check_frozen_parts(FAMILY, trainer, before, after, trained)


def test_freeze_names_only_the_familys_parts(tiny_qwen2_5_vl, tmp_path):
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    cfg = load_job_config(
        None, vlm_overrides(tiny_qwen2_5_vl, tmp_path / "d.jsonl", tmp_path, train__freeze='["audio"]')
    )
    with pytest.raises(ConfigError, match=r"train\.freeze names \['audio'\], which qwen2_5_vl models do not have"):
        check_job_plan(cfg, 1)


def test_lora_trains_adapters_and_refuses_a_merged_export(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    trainer, _ = omni_train(
        tiny_qwen2_5_omni, omni_conversations, tmp_path / "run", train__max_steps=2, train__lora='{"rank": 4}'
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora" in n and n.startswith("model.language_model.") for n in trainable)
    assert (tmp_path / "run" / "export" / "lora" / "adapter_model.safetensors").is_file()
    cfg = load_job_config(
        None,
        omni_overrides(
            tiny_qwen2_5_omni, omni_conversations, tmp_path, train__lora='{"rank": 4}', export__merge_lora=True
        ),
    )
    with pytest.raises(ConfigError, match=r"export\.merge_lora"):
        check_job_plan(cfg, 1)


def video_step(model: Path, out: Path, use_audio_in_video: bool) -> tuple[Any, dict, dict]:
    """Spindle's step 1 on one conversation about a video with an audio track (`suite.video_conversation`,
    `data.use_audio_in_video` as given): the trainer, its logged metrics and the row as the stock thinker
    takes it (`suite.row_stock_inputs`)."""
    data = suite.video_conversation(out / "data")
    trainer, _ = omni_train(
        model, data, out / "run", data__packing=False, train__max_steps=1, data__use_audio_in_video=use_audio_in_video
    )
    logged = json.loads((out / "run" / "metrics.jsonl").read_text().splitlines()[0])
    return trainer, logged, suite.row_stock_inputs(trainer.loader.dataset[0], use_audio_in_video)


def test_use_audio_in_video_step1_equals_the_stock_thinker(tiny_qwen2_5_omni, tiny_qwen2_5_vl, tmp_path):
    """A video with its audio track (`data.use_audio_in_video`): step 1's loss and grad norm equal the stock
    thinker given Spindle's tokens, frames and track features, computing its own positions with
    use_audio_in_video. A VLM family refuses the option."""
    from spindle.api import check_job_plan
    from spindle.config import ConfigError

    _, logged, inputs = video_step(tiny_qwen2_5_omni, tmp_path, use_audio_in_video=True)
    check_stock_step(FAMILY, suite.stock_thinker(FAMILY, tiny_qwen2_5_omni), inputs, logged)

    data = tmp_path / "data" / "data.jsonl"
    cfg = load_job_config(None, vlm_overrides(tiny_qwen2_5_vl, data, tmp_path, data__use_audio_in_video=True))
    with pytest.raises(ConfigError, match=r"data\.use_audio_in_video: qwen2_5_vl models: they do not take"):
        check_job_plan(cfg, 1)


def test_the_talker_and_token2wav_are_never_read_for_training(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """The tensors the training model is loaded from are the thinker's only; the model holds no talker."""
    trainer = make_trainer(load_job_config(None, omni_overrides(tiny_qwen2_5_omni, omni_conversations, tmp_path)))
    sources = trainer.task.checkpoint_sources()
    assert set(sources) == set(trainer.model.state_dict())
    names = [n for n, _ in trainer.model.named_modules()]
    assert not any("talker" in n or "token2wav" in n for n in names)
    assert type(trainer.model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"


def test_gradient_checkpointing_equals_the_plain_run(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """Activation checkpointing recomputes encoder layers, vision blocks and decoder layers (with the tower and
    language-model hooks, audio-free and image-free rows included): the same losses and grad norms."""
    runs = []
    for ac in (False, True):
        out = tmp_path / f"ac_{ac}"
        omni_train(
            tiny_qwen2_5_omni,
            omni_conversations,
            out,
            train__max_steps=2,
            data__packing=False,
            train__global_batch_size=2,
            train__gradient_checkpointing=ac,
        )
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs[1]] == pytest.approx([m[key] for m in runs[0]], rel=1e-5), key


def test_whole_model_load_path_equals_the_sharded_one(tiny_qwen2_5_omni, omni_conversations, tmp_path):
    """`model.sharded_load: false` (the thinker's own from_pretrained of the whole folder, which skips the
    talker's tensors) trains exactly as the sharded read of the thinker's tensors."""
    runs = []
    for sharded in (True, False):
        out = tmp_path / f"sharded_{sharded}"
        omni_train(tiny_qwen2_5_omni, omni_conversations, out, train__max_steps=2, model__sharded_load=sharded)
        runs.append([json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()])
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in runs[1]] == [m[key] for m in runs[0]], key
