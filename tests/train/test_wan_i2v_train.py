"""Wan2.1 I2V training inputs: the conditioning image (a clip's first frame, or the manifest's "image")
encoded exactly as stock WanImageToVideoPipeline feeds its transformer. (Training runs, the export loaded
by the stock pipeline, precomputed conditions and SP = one process: tests/conformance for wan_i2v.)"""

from __future__ import annotations

import json

import pytest
import torch

from spindle.data.datasets import build_dataset, collate
from spindle.data.media import tensor_to_image
from spindle.models.wan_i2v import TEXT_LENGTH

SIZE, FRAMES = (32, 32), 9


@pytest.fixture(scope="module")
def condition(tiny_wan_i2v):
    from spindle.models.wan_i2v.condition import WanI2VConditionModel

    return WanI2VConditionModel.from_pretrained(tiny_wan_i2v, max_text_length=TEXT_LENGTH)


def stock_transformer_inputs(root, image, prompt: str) -> dict:
    """What stock WanImageToVideoPipeline hands its transformer at the first step for `image`."""
    from diffusers import WanImageToVideoPipeline

    from tests.conftest import first_transformer_inputs

    return first_transformer_inputs(
        WanImageToVideoPipeline.from_pretrained(root), image=image, prompt=prompt, height=SIZE[0], width=SIZE[1],
        num_frames=FRAMES, num_inference_steps=1, guidance_scale=1.0, output_type="latent",
    )  # fmt: skip


def test_first_frame_conditions_equal_the_stock_pipelines(condition, tiny_wan_i2v, shapes_videos):
    dataset = build_dataset(shapes_videos, SIZE, FRAMES)
    batch = collate([dataset.load(0), dataset.load(3)])
    conditions = condition.encode(batch)
    z = condition.latents_mean.shape[1]
    for i in range(2):
        first = tensor_to_image(batch["pixels"][i, :, 0])
        stock = stock_transformer_inputs(tiny_wan_i2v, first, batch["caption"][i])
        torch.testing.assert_close(conditions["condition"][i : i + 1], stock["hidden_states"][:, z:], atol=1e-6, rtol=0)
        torch.testing.assert_close(
            conditions["image_embeds"][i], stock["encoder_hidden_states_image"], atol=1e-6, rtol=0
        )
        torch.testing.assert_close(
            conditions["prompt_embeds"][i : i + 1], stock["encoder_hidden_states"], atol=1e-6, rtol=0
        )
    inputs = condition.training_inputs(conditions, [torch.Generator().manual_seed(i) for i in range(2)])
    assert inputs["hidden_states"].shape[1] == 2 * z + 4
    torch.testing.assert_close(inputs["hidden_states"][:, z:], conditions["condition"])


def test_manifest_image_replaces_the_first_frame(condition, shapes_videos, tmp_path):
    clips = sorted(shapes_videos.glob("*.mp4"))
    other = build_dataset(shapes_videos, SIZE, FRAMES).load(5)["pixels"][:, 0]
    tensor_to_image(other).save(tmp_path / "cond.png")
    manifest = tmp_path / "data.jsonl"
    lines = [
        {"path": str(clips[0]), "caption": "a clip", "image": "cond.png"},  # relative to the manifest
        {"path": str(clips[1]), "caption": "another clip"},
    ]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dataset = build_dataset(manifest, SIZE, FRAMES)
    batch = collate([dataset[0], dataset[1]])
    torch.testing.assert_close(batch["image"][0], other)  # the png, decoded as the frames are
    torch.testing.assert_close(batch["image"][1], batch["pixels"][1, :, 0])  # no "image": the first frame
    got = condition.encode(batch)
    default = condition.encode({k: v for k, v in batch.items() if k != "image"})
    explicit = condition.encode_images(other[None], FRAMES)
    torch.testing.assert_close(got["condition"][:1], explicit["condition"])
    torch.testing.assert_close(got["image_embeds"][:1], explicit["image_embeds"])
    assert not torch.allclose(got["condition"][:1], default["condition"][:1])
    torch.testing.assert_close(got["condition"][1:], default["condition"][1:])


@pytest.mark.parametrize(
    "image, match",
    [
        ("cond.mp4", r"'image' must be an image file; unsupported extension '.mp4'"),
        ("missing.png", r"conditioning image .*missing.png: file does not exist"),
        (3, r"'image' must be a string path; got int"),
    ],
)
def test_manifest_image_errors_name_the_line(shapes_videos, tmp_path, image, match):
    clip = sorted(shapes_videos.glob("*.mp4"))[0]
    manifest = tmp_path / "data.jsonl"
    manifest.write_text(json.dumps({"path": str(clip), "caption": "a clip", "image": image}) + "\n")
    with pytest.raises(ValueError, match=match):  # MediaError is a ValueError
        build_dataset(manifest, SIZE, FRAMES)


def test_text_length_other_than_512_is_refused(tiny_wan_i2v):
    from spindle.models.wan_i2v.condition import WanI2VConditionModel

    with pytest.raises(ValueError, match=r"model.max_text_length must be 512 for Wan I2V \(got 16\)"):
        WanI2VConditionModel.from_pretrained(tiny_wan_i2v, max_text_length=16)


def test_validation_samples_take_their_conditioning_images(tiny_wan_i2v, shapes_videos, tmp_path):
    import numpy as np

    from spindle.api import load_job_config, make_trainer
    from spindle.data.media import read_video
    from tests.conftest import train_overrides

    frame = build_dataset(shapes_videos, SIZE, FRAMES).load(2)["pixels"][:, 0]
    tensor_to_image(frame).save(tmp_path / "first.png")
    overrides = train_overrides(
        tiny_wan_i2v, shapes_videos, tmp_path / "run", model__max_text_length=TEXT_LENGTH, train__max_steps=1,
        train__validation__every_steps=1, train__validation__num_inference_steps=2,
        train__validation__prompts='["a red circle"]', train__validation__num_frames=5,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"train.validation.images: wan_i2v needs a conditioning image per"):
        make_trainer(load_job_config(None, overrides))
    result = make_trainer(
        load_job_config(None, [*overrides, f'train.validation.images=["{tmp_path / "first.png"}"]'])
    ).run()
    sample = result.output_dir / "samples" / "step-000001" / "00.mp4"
    video = read_video(sample, 5, SIZE)  # [3, F, H, W] in [-1, 1]
    assert video.shape == (3, 5, *SIZE)
    assert np.isfinite(video.numpy()).all()
    prompts = json.loads((result.output_dir / "samples" / "step-000001" / "prompts.json").read_text())
    assert prompts["images"] == [str(tmp_path / "first.png")]
