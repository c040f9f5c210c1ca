"""First-last-frame (Wan FLF2V) training inputs: a manifest's `"last_image"` is encoded exactly as stock
WanImageToVideoPipeline feeds its transformer for `image` + `last_image` (CLIP states of both frames, the
VAE-encoded first and last frames with their mask); batches mixing entries with and without one, and a
checkpoint that cannot take one, are refused naming the key."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.data.datasets import build_dataset, collate
from spindle.models.wan_i2v import TEXT_LENGTH
from spindle.train.tasks.flow_matching import load_transformer, sample_generator
from tests.train.test_wan_i2v_train import FRAMES, SIZE


@pytest.fixture(scope="module")
def manifest(shapes_videos, tmp_path_factory):
    """Clip 0 and 1 with a first and a last frame image (other clips' frames), clip 2 without."""
    folder = tmp_path_factory.mktemp("flf2v-data")
    clips = sorted(shapes_videos.glob("*.mp4"))
    frames = build_dataset(shapes_videos, SIZE, FRAMES)
    from spindle.data.media import tensor_to_image

    for name, (clip, frame) in {"a": (5, 0), "b": (6, FRAMES - 1)}.items():
        tensor_to_image(frames.load(clip)["pixels"][:, frame]).save(folder / f"{name}.png")
    lines = [
        {"path": str(clips[0]), "caption": "a clip", "image": "a.png", "last_image": "b.png"},
        {"path": str(clips[1]), "caption": "another clip", "last_image": "a.png"},  # first frame: the clip's
        {"path": str(clips[2]), "caption": "no last frame"},
    ]
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def stock_inputs(root, image, last_image, prompt: str) -> dict:
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(root)
    seen: dict = {}
    pipe.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.setdefault("inputs", kw) and None, with_kwargs=True
    )
    pipe(
        image=image, last_image=last_image, prompt=prompt, height=SIZE[0], width=SIZE[1], num_frames=FRAMES,
        num_inference_steps=1, guidance_scale=1.0, output_type="latent",
    )  # fmt: skip
    return seen["inputs"]


def test_last_frame_conditions_equal_the_stock_pipelines(tiny_wan_flf2v, manifest):
    from spindle.data.media import tensor_to_image
    from spindle.models.wan_i2v.condition import WanI2VConditionModel

    condition = WanI2VConditionModel.from_pretrained(tiny_wan_flf2v, max_text_length=TEXT_LENGTH)
    dataset = build_dataset(manifest, SIZE, FRAMES)
    batch = collate([dataset[0], dataset[1]])
    conditions = condition.encode(batch)
    z = condition.latents_mean.shape[1]
    for i in range(2):
        first, last = tensor_to_image(batch["image"][i]), tensor_to_image(batch["last_image"][i])
        stock = stock_inputs(tiny_wan_flf2v, first, last, batch["caption"][i])
        torch.testing.assert_close(conditions["condition"][i : i + 1], stock["hidden_states"][:, z:], atol=1e-6, rtol=0)
        torch.testing.assert_close(
            conditions["image_embeds"][i], stock["encoder_hidden_states_image"], atol=1e-6, rtol=0
        )
    # the transformer folds two images per sample: data without last frames is refused naming the key
    with pytest.raises(ValueError, match=r"this first-last-frame \(FLF2V\) checkpoint needs a 'last_image'"):
        condition.encode({k: v for k, v in batch.items() if k != "last_image"})
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    target = inputs.pop("target")
    inputs.pop("sigmas")
    with torch.no_grad():
        pred = load_transformer(tiny_wan_flf2v)(**inputs, return_dict=False)[0]
    assert pred.shape == target.shape


def test_last_image_is_refused_where_it_cannot_apply(tiny_wan_i2v, manifest):
    from spindle.models.wan_i2v.condition import WanI2VConditionModel

    dataset = build_dataset(manifest, SIZE, FRAMES)
    with pytest.raises(ValueError, match=r"only \[0\] name a 'last_image'; give every manifest entry a last_image"):
        collate([dataset[0], dataset[2]])
    condition = WanI2VConditionModel.from_pretrained(tiny_wan_i2v, max_text_length=TEXT_LENGTH)
    with pytest.raises(ValueError, match=r"the data names a 'last_image', but this checkpoint is not first-last-frame"):
        condition.encode(collate([dataset[0]]))


def test_validation_renders_from_a_first_and_a_last_frame_per_prompt(tiny_wan_flf2v, manifest, tmp_path):
    """An FLF2V checkpoint's validation request takes [first, last] per prompt: one image is refused before
    launch naming the entry and what the checkpoint takes, and the pair renders at the validation step."""
    from spindle.api import load_job_config, make_trainer
    from spindle.data.media import read_video
    from tests.conftest import train_overrides

    lines = [json.loads(line) for line in manifest.read_text().splitlines()]
    data = manifest.with_name("with_last.jsonl")  # beside the images the entries name
    data.write_text("".join(json.dumps(line) + "\n" for line in lines if "last_image" in line))
    first, last = manifest.parent / "a.png", manifest.parent / "b.png"
    overrides = train_overrides(
        tiny_wan_flf2v, data, tmp_path / "run", model__max_text_length=TEXT_LENGTH, train__max_steps=1,
        train__global_batch_size=2, train__validation__every_steps=1, train__validation__num_inference_steps=2,
        train__validation__prompts='["a clip"]', train__validation__num_frames=5,
    )  # fmt: skip
    refused = r"train.validation.images\[0\]: wan_i2v takes 2 conditioning image\(s\); got 1 \(a request to /"
    with pytest.raises(ValueError, match=refused):
        make_trainer(load_job_config(None, [*overrides, f'train.validation.images=["{first}"]']))
    pair = f'train.validation.images=[["{first}", "{last}"]]'
    result = make_trainer(load_job_config(None, [*overrides, pair])).run()
    sample = read_video(result.output_dir / "samples" / "step-000001" / "00.mp4", 5, SIZE)
    assert sample.shape == (3, 5, *SIZE) and torch.isfinite(sample).all()
