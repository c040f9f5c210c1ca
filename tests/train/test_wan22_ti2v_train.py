"""Wan2.2 TI2V-5B image-to-video training (family wan22_ti2v, a batch with conditioning images): the first
latent frame and the per-token timesteps are what stock WanImageToVideoPipeline (expand_timesteps) feeds its
transformer, and the loss leaves the clean first frame out. (Text-to-video training and its stock-loaded
export: tests/conformance for wan22_ti2v.)"""

from __future__ import annotations

import json

import pytest
import torch

from spindle.api import load_job_config, make_trainer
from spindle.data.datasets import build_dataset, collate
from spindle.data.media import tensor_to_image
from tests.conftest import train_overrides

SIZE, FRAMES = (64, 64), 9


@pytest.fixture(scope="module")
def tiny_ti2v(tiny_checkpoint):
    return tiny_checkpoint("wan22_ti2v")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    from spindle.data.synthetic import make_shapes_video_dataset

    folder = make_shapes_video_dataset(tmp_path_factory.mktemp("ti2v") / "clips", num_videos=4, num_frames=9, size=SIZE)
    clips = sorted(folder.glob("*.mp4"))
    frame = build_dataset(folder, SIZE, FRAMES).load(3)["pixels"][:, 0]  # another clip's frame
    tensor_to_image(frame).save(folder / "cond.png")
    lines = [{"path": str(clip), "caption": f"clip {i}", "image": "cond.png"} for i, clip in enumerate(clips)]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_image_to_video_inputs_are_the_stock_pipelines(tiny_ti2v, manifest):
    from diffusers import WanImageToVideoPipeline

    from spindle.models.wan22_ti2v.condition import Wan22TI2VConditionModel
    from spindle.train.tasks.flow_matching import sample_generator

    condition = Wan22TI2VConditionModel.from_pretrained(tiny_ti2v, max_text_length=16)
    batch = collate([build_dataset(manifest, SIZE, FRAMES)[0]])
    conditions = condition.encode(batch)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, 0)])
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_ti2v)
    seen: dict = {}
    pipe.transformer.register_forward_pre_hook(lambda m, a, kw: seen.setdefault("kw", kw) and None, with_kwargs=True)
    pipe(
        image=tensor_to_image(batch["image"][0]), prompt="clip 0", height=SIZE[0], width=SIZE[1], num_frames=FRAMES,
        num_inference_steps=1, guidance_scale=1.0, max_sequence_length=16, output_type="latent",
    )  # fmt: skip
    stock = seen["kw"]
    torch.testing.assert_close(inputs["hidden_states"][:, :, 0], stock["hidden_states"][:, :, 0], atol=1e-6, rtol=0)
    assert inputs["timestep"].shape == stock["timestep"].shape
    first = stock["timestep"] == 0  # the image's tokens: timestep 0 in both
    assert bool(first.any()) and torch.equal(inputs["timestep"] == 0, first)
    torch.testing.assert_close(inputs["encoder_hidden_states"], stock["encoder_hidden_states"], atol=1e-6, rtol=0)
    # the other latent frames are the noisy latents at the sample's timestep
    assert not torch.allclose(inputs["hidden_states"][:, :, 1:], conditions["latents"][:, :, 1:])


def test_the_loss_leaves_the_clean_first_frame_out(tiny_ti2v, manifest, tmp_path, monkeypatch):
    overrides = train_overrides(
        tiny_ti2v, manifest, tmp_path / "run", data__resolution=list(SIZE), model__max_text_length=16,
        train__max_steps=1, train__global_batch_size=2, train__micro_batch_size=2,
    )  # fmt: skip
    trainer = make_trainer(load_job_config(None, overrides))
    task, model = trainer.task, trainer.model
    batch = collate([build_dataset(manifest, SIZE, FRAMES)[i] for i in range(2)])
    with torch.no_grad():
        loss = task.forward(model, batch, 0).loss_sum
    original = task.condition.training_inputs

    def first_frame_target_changed(conditions, generators):
        inputs = original(conditions, generators)
        inputs["target"][:, :, 0] += 100.0
        return inputs

    monkeypatch.setattr(task.condition, "training_inputs", first_frame_target_changed)
    with torch.no_grad():
        assert task.forward(model, batch, 0).loss_sum == loss
    monkeypatch.setattr(task.condition, "training_inputs", original)
    result = trainer.run()  # and a step trains
    assert result.export_dir is not None and (result.export_dir / "transformer").is_dir()
