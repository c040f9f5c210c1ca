"""Single-process fine-tuning: loss falls, resume is exact, export round-trips into stock diffusers."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spindle.api import make_trainer, train
from spindle.train.metrics import read_metrics
from tests.conftest import RESUME_RUN, run_spindle, train_interrupted


def test_overfit_loss_falls(make_config, tmp_path):
    cfg = make_config(
        train__max_steps=40,
        train__lr=2e-3,
        train__global_batch_size=4,
        train__micro_batch_size=4,
        checkpoint__export=False,
    )
    train(cfg)
    losses = [m["loss"] for m in read_metrics(cfg.train.output_dir)]
    assert len(losses) == 40
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < 0.6 * first, f"loss did not fall enough: {first:.4f} -> {last:.4f}"


def test_metrics_lines_have_required_fields(make_config):
    cfg = make_config(train__max_steps=2, checkpoint__export=False)
    train(cfg)
    records = read_metrics(cfg.train.output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s"):
        assert all(isinstance(r[key], float) and r[key] >= 0 for r in records), key
    # 4 samples of 3x4x4 latents with 1x2x2 patches = 4 * 12 tokens per step
    assert records[0]["tokens_per_s"] / records[0]["samples_per_s"] == pytest.approx(12)


def test_interrupted_run_resumes_to_identical_losses(make_config, tmp_path, monkeypatch):
    common = RESUME_RUN
    train(make_config(tmp_path / "straight", **common))

    train_interrupted(make_config, tmp_path / "resumed", monkeypatch, 7, **common)
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir())
    assert ckpts == ["step-000003", "step-000006"]  # no partial (.tmp) checkpoint left behind
    train(make_config(tmp_path / "resumed", checkpoint__resume="auto", **common))

    straight = [m["loss"] for m in read_metrics(tmp_path / "straight")]
    resumed = [m["loss"] for m in read_metrics(tmp_path / "resumed")]
    assert [m["step"] for m in read_metrics(tmp_path / "resumed")] == list(range(1, 9))
    assert resumed == straight  # exact on CPU fp32


def test_export_round_trip_in_stock_diffusers(make_config, tiny_wan):
    from diffusers import WanPipeline, WanTransformer3DModel

    cfg = make_config(train__max_steps=3)
    trainer = make_trainer(cfg)
    result = trainer.run()
    trained = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trained.items()}

    exported = load_file(result.export_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == trained.keys()
    for key, value in trained.items():
        assert torch.equal(exported[key], value), key
    original = load_file(tiny_wan / "transformer" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(original[k], exported[k]) for k in original), "training changed nothing"

    config = json.loads((result.export_dir / "transformer" / "config.json").read_text())
    base = json.loads((tiny_wan / "transformer" / "config.json").read_text())
    assert set(config) == set(base), "exported config.json must hold only diffusers keys"

    model = WanTransformer3DModel.from_pretrained(result.export_dir / "transformer")
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    pipe = WanPipeline.from_pretrained(result.export_dir)
    frames = pipe(
        prompt="a red circle moves left",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=1.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3)


def test_export_cli_matches_end_of_training_export(make_config, tmp_path):
    cfg = make_config(train__max_steps=2)
    result = train(cfg)
    out = tmp_path / "cli_export"
    proc = run_spindle("export", cfg.train.output_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    a = load_file(result.export_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    b = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "model_index.json").read_text() == (result.export_dir / "model_index.json").read_text()


def test_streamed_export_of_a_checkpoint_writes_sharded_files_stock_diffusers_loads(make_config, tmp_path):
    """`spindle export` never builds the model: shard by shard from the checkpoint, into the sharded layout
    (`*-0000i-of-0000n.safetensors` + index) `save_pretrained` writes for a big model."""
    from diffusers import WanTransformer3DModel

    from spindle.distributed import checkpoint as ckpt
    from spindle.export.diffusers import transformer_from_config
    from spindle.export.dtypes import export_dtypes
    from spindle.export.streamed import checkpoint_then_base, write_streamed

    cfg = make_config(train__max_steps=2)
    result = train(cfg)
    checkpoint = ckpt.list_checkpoints(cfg.train.output_dir)[-1]
    base = Path(cfg.model.path) / "transformer"
    expected = transformer_from_config(cfg.model.path).state_dict()
    out = tmp_path / "sharded"
    read = checkpoint_then_base(checkpoint, base)
    write_streamed(expected, read, out, "diffusion_pytorch_model.safetensors", export_dtypes("auto", base), 20_000)
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    per_file = {f: sum(1 for v in index["weight_map"].values() if v == f) for f in files}
    assert len(files) > 2  # a bigger tensor gets a file of its own; the others stay under the bound
    assert all((out / f).stat().st_size < 20_000 + 4096 for f, n in per_file.items() if n > 1)
    (out / "config.json").write_text((base / "config.json").read_text())
    loaded = WanTransformer3DModel.from_pretrained(out).state_dict()
    whole = load_file(result.export_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert loaded.keys() == whole.keys() and all(torch.equal(loaded[k], whole[k]) for k in whole)


def test_export_names_a_checkpoint_from_another_base_model(make_config, tmp_path):
    cfg = make_config(train__max_steps=1, checkpoint__export=False)
    train(cfg)
    other = tmp_path / "other"
    from spindle.models.wan.tiny import build_tiny as build_tiny_wan

    build_tiny_wan(other, transformer={"num_layers": 1})
    proc = run_spindle("export", cfg.train.output_dir, "--out", tmp_path / "x", "--model", other)
    assert proc.returncode != 0
    assert "another base model" in proc.stderr and "unexpected" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()


def test_export_cli_rejects_non_checkpoint(tmp_path, spindle_cli):
    proc = spindle_cli("export", tmp_path, "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert "neither a Spindle checkpoint" in proc.stderr


def test_bad_video_in_dataset_names_the_file(make_config, shapes_videos, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(shapes_videos, data)
    (data / "clip_002.mp4").write_bytes(b"not a video at all")
    from spindle.data.media_check import DataCheckError

    cfg = make_config(data__path=data, train__max_steps=3, checkpoint__export=False, data__shuffle=False)
    with pytest.raises(DataCheckError, match=re.escape("clip_002.mp4: unreadable video")):
        train(cfg)  # found by the up-front check, before the model is built

    cfg = make_config(
        tmp_path / "skip",
        data__path=data,
        train__max_steps=3,
        checkpoint__export=False,
        data__shuffle=False,
        data__skip_bad_samples=True,
    )
    trainer = make_trainer(cfg)
    trainer.run()
    assert trainer.loader.dataset.skipped_files == [data / "clip_002.mp4"]  # left out before training
    assert trainer.loader.dataset.num_skipped == 0  # so never met while training


def test_gradient_checkpointing_gives_the_same_run(make_config, tmp_path):
    common = dict(train__max_steps=3, checkpoint__export=False)
    train(make_config(tmp_path / "plain", **common))
    train(make_config(tmp_path / "ckpt", train__gradient_checkpointing=True, **common))
    for key in ("loss", "grad_norm"):
        plain = [m[key] for m in read_metrics(tmp_path / "plain")]
        recomputed = [m[key] for m in read_metrics(tmp_path / "ckpt")]
        assert recomputed == pytest.approx(plain, rel=1e-6), key
