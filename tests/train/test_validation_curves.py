"""Validation samples during training, TensorBoard event files, and `spindle plot`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from spindle.api import make_trainer, train
from spindle.train.metrics import read_metrics
from tests.conftest import TINY_TEXT, run_spindle

COMMON = dict(train__max_steps=3, train__global_batch_size=2, checkpoint__export=False)
VALIDATION = (
    '{every_steps: 2, prompts: ["a red circle moves left", "a blue square"], seed: 7, '
    "num_inference_steps: 2, size: [32, 32], num_frames: 5, guidance_scale: 1.0}"
)


@pytest.fixture(scope="module")
def validated(tiny_wan, shapes_videos, tmp_path_factory):
    from spindle.api import load_job_config
    from tests.conftest import train_overrides

    out = tmp_path_factory.mktemp("validated") / "run"
    cfg = load_job_config(None, train_overrides(tiny_wan, shapes_videos, out, train__validation=VALIDATION, **COMMON))
    trainer = make_trainer(cfg)
    trainer.run()
    return trainer


def test_samples_appear_at_the_right_steps(validated):
    samples = validated.output_dir / "samples"
    assert sorted(p.name for p in samples.iterdir()) == ["step-000002"]
    assert sorted(p.name for p in (samples / "step-000002").iterdir()) == ["00.mp4", "01.mp4", "prompts.json"]
    from spindle.data.media import probe_video

    frames, _, height, width = probe_video(samples / "step-000002" / "00.mp4")
    assert (frames, height, width) == (5, 32, 32)
    # the prompts are encoded at the text length training uses (model.max_text_length), not the pipeline's 512
    record = json.loads((samples / "step-000002" / "prompts.json").read_text())
    assert record["max_sequence_length"] == validated.cfg.model.max_text_length == TINY_TEXT


def test_validation_leaves_the_training_trajectory_unchanged(validated, make_config, tmp_path):
    train(make_config(tmp_path / "plain", **COMMON))
    # Equal to fp32 rounding, not bit for bit: validation's allocations move later tensors in memory, and with one
    # thread (OMP_NUM_THREADS=1) the matmul kernels' results depend on alignment (1e-7 seen at step 3). A validation
    # that consumed the training RNG (the bug this guards) changes the noise, and the losses by far more.
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in read_metrics(validated.output_dir)] == pytest.approx(
            [m[key] for m in read_metrics(tmp_path / "plain")], rel=1e-6
        )


def test_same_seed_same_weights_same_sample(validated, tmp_path):
    import torch

    model = validated.model
    model.eval()
    with torch.no_grad():
        a = validated.task.validate(model, 3, tmp_path / "a")
        b = validated.task.validate(model, 3, tmp_path / "b")
    model.train()
    assert len(a) == 2 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], a[1]), "different prompts gave the same sample"


def test_tensorboard_events_hold_the_logged_scalars_and_samples(validated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(validated.output_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    records = read_metrics(validated.output_dir)
    for key in ("loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s"):
        logged = events.Scalars(f"train/{key}")
        assert [e.step for e in logged] == [1, 2, 3]
        assert [e.value for e in logged] == pytest.approx([r[key] for r in records], rel=1e-6)
    images = events.Images("samples/0")
    assert [e.step for e in images] == [2]
    assert (images[0].width, images[0].height) == (5 * 32, 32)  # the 5 frames side by side


def test_tensorboard_off(make_config, tmp_path):
    cfg = make_config(tmp_path / "run", train__tensorboard=False, **{**COMMON, "train__max_steps": 1})
    train(cfg)
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_plot_writes_a_loss_png(validated, tmp_path):
    out = tmp_path / "curve.png"
    proc = run_spindle("plot", validated.output_dir, "--out", out)
    assert proc.returncode == 0, proc.stderr
    image = np.asarray(Image.open(out).convert("RGB"))
    assert image.shape == (450, 800, 3)
    # the curves are drawn: blue (loss) and orange (lr) pixels exist
    assert ((image[..., 2] > 150) & (image[..., 0] < 100)).sum() > 50
    assert ((image[..., 0] > 200) & (image[..., 1] > 100) & (image[..., 2] < 80)).sum() > 50


def test_plot_names_a_missing_metrics_file(tmp_path):
    proc = run_spindle("plot", tmp_path)
    assert proc.returncode == 2 and "metrics.jsonl not found" in proc.stderr
