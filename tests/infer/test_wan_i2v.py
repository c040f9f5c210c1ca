"""Wan2.1 image-to-video inference: the tiny layout, parity with stock WanImageToVideoPipeline, the image
inputs (PIL, array, path; `spindle generate --image`) and the errors for images a model cannot take."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spindle.api import load_generator

CASES = {
    "cfg": dict(
        prompt="a red fox",
        negative_prompt="blurry",
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=0,
    ),
    "nocfg": dict(
        prompt="a red fox", height=32, width=32, num_frames=9, num_inference_steps=2, guidance_scale=1.0, seed=3
    ),
}


def first_frame(height: int = 40, width: int = 56, seed: int = 0):
    """A random RGB image whose size differs from the video's: the pipeline resizes it."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def gen(tiny_wan_i2v):
    return load_generator(tiny_wan_i2v)


@pytest.fixture(scope="module")
def stock(tiny_wan_i2v):
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(tiny_wan_i2v)


def stock_frames(stock, image, seed: int, **kwargs) -> np.ndarray:
    import torch

    return stock(image=image, generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs).frames


def test_tiny_layout_is_the_diffusers_i2v_layout(tiny_wan_i2v):
    from spindle.registry import resolve_family

    index = json.loads((tiny_wan_i2v / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    tcfg = json.loads((tiny_wan_i2v / "transformer" / "config.json").read_text())
    z = json.loads((tiny_wan_i2v / "vae" / "config.json").read_text())["z_dim"]
    assert (tcfg["in_channels"], tcfg["out_channels"]) == (2 * z + 4, z)
    assert tcfg["image_dim"] is not None
    assert resolve_family(tiny_wan_i2v).name == "wan_i2v"


@pytest.mark.parametrize("case", sorted(CASES))
def test_generate_equals_stock_pipeline(gen, stock, case):
    kwargs = dict(CASES[case])
    seed = kwargs.pop("seed")
    image = first_frame()
    ref = stock_frames(stock, image, seed, **kwargs)
    out = gen.generate(image=image, seed=seed, **kwargs).frames
    assert out.shape == ref.shape == (1, kwargs["num_frames"], kwargs["height"], kwargs["width"], 3)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


def test_image_as_array_path_or_list_is_the_same_image(gen, tmp_path):
    image = first_frame(seed=1)
    path = tmp_path / "first.png"
    image.save(path)
    kwargs = dict(CASES["nocfg"], num_frames=5)
    base = gen.generate(image=image, **kwargs).frames
    for other in (np.asarray(image), str(path), path, [image]):
        np.testing.assert_array_equal(gen.generate(image=other, **kwargs).frames, base)
    # the image conditions the video: another image gives another video
    assert np.abs(gen.generate(image=first_frame(seed=2), **kwargs).frames - base).max() > 1e-3


@pytest.mark.parametrize(
    "image, match",
    [
        (None, r"image is required for wan_i2v"),
        ("missing.png", r"image file '.*missing.png' does not exist"),
        ("garbage.png", r"image file '.*garbage.png' cannot be read as an image"),
        (np.zeros((8, 8, 3), dtype=np.float32), r"image array must be uint8 of shape \[H, W, 3\]"),
        (np.zeros((8, 8, 4), dtype=np.uint8), r"image array must be uint8 of shape \[H, W, 3\]"),
        (12, r"image must be a PIL image, a uint8 \[H, W, 3\] array or an image file path; got 12"),
        ("three", r"image: wan_i2v takes 1 to 2 conditioning image\(s\); got 3"),
    ],
)
def test_bad_image_is_a_request_error_naming_the_field(gen, tmp_path, image, match):
    from spindle.contracts.request import RequestError, SamplingParams

    (tmp_path / "garbage.png").write_bytes(b"not a png")
    if isinstance(image, str):
        image = [first_frame()] * 3 if image == "three" else tmp_path / image
    with pytest.raises(RequestError, match=match) as info:
        gen.validate(
            SamplingParams(prompt="a fox", image=image if isinstance(image, list) or image is None else [image])
        )
    assert info.value.field == "image"


def test_text_length_other_than_512_is_refused(gen):
    from spindle.contracts.request import RequestError, SamplingParams

    with pytest.raises(RequestError, match=r"max_sequence_length must be 512 for this model"):
        gen.validate(SamplingParams(prompt="a fox", image=[first_frame()], max_sequence_length=64))


def test_text_to_video_model_refuses_an_image(tiny_wan):
    from spindle.contracts.request import RequestError

    with pytest.raises(RequestError, match=r"image is not taken by wan \(it generates from text alone\)"):
        load_generator(tiny_wan).generate(prompt="a fox", image=first_frame(), num_frames=5, height=32, width=32)


def test_cli_generate_with_image_equals_stock(spindle_cli, stock, tiny_wan_i2v, tmp_path):
    from spindle.data.media import read_video

    image = first_frame(seed=4)
    image.save(tmp_path / "first.png")
    kwargs = dict(CASES["nocfg"], num_frames=5)
    out = tmp_path / "out.mp4"
    result = spindle_cli(
        "generate", "--model", tiny_wan_i2v, "--prompt", kwargs["prompt"], "--image", tmp_path / "first.png",
        "--height", 32, "--width", 32, "--num-frames", 5, "--steps", 2, "--guidance", 1.0, "--seed", 3,
        "--out", out, "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "family wan_i2v" in result.stdout
    ref = stock_frames(stock, image, 3, **{k: v for k, v in kwargs.items() if k != "seed"})[0]
    written = (read_video(out, 5, (32, 32)).permute(1, 2, 3, 0).numpy() + 1) / 2  # [F, H, W, 3] in [0, 1]
    assert written.shape == ref.shape
    assert np.abs(written - ref).mean() < 0.05  # mp4 is lossy: decoded pixels agree loosely
    bad = spindle_cli(
        "generate", "--model", tiny_wan_i2v, "--prompt", "a fox", "--out", out, "--image", tmp_path / "nope.png"
    )
    assert bad.returncode == 2 and "image file" in bad.stderr and "does not exist" in bad.stderr
    assert "Traceback" not in bad.stderr
