"""FLUX.1 Kontext inference beyond the conformance suite (which checks parity at its two cases): the
pipeline's own sizing of the source image (auto_resize: the preferred Kontext resolutions) and of the
output (max_area), a batch of prompts, no source image, the image inputs and `spindle generate --image`,
and the refusals of what the pipeline would silently change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.contracts.request import RequestError, SamplingParams

BASE = dict(prompt="the red circle to blue", num_inference_steps=2, guidance_scale=2.5, max_sequence_length=16)


def source(height: int = 40, width: int = 56, seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def gen(tiny_flux_kontext):
    return load_generator(tiny_flux_kontext)


@pytest.fixture(scope="module")
def stock(tiny_flux_kontext):
    from diffusers import FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_images(stock, seed: int, auto_resize: bool = True, **kwargs) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return stock(**kwargs, _auto_resize=auto_resize, generator=generator, output_type="np").images


@pytest.mark.parametrize(
    "request_",
    [
        # max_area other than height x width: the pipeline's fit keeps 32x48 (rounded to the multiple of 4)
        dict(image=source(), height=32, width=48, max_area=1600),
        # two prompts, one source (repeated per prompt, as the pipeline does), two outputs each
        dict(
            image=source(), height=32, width=32, max_area=1024, prompt=["a", "the red circle"], num_outputs_per_prompt=2
        ),
        # no source image: Kontext's text-to-image
        dict(height=32, width=48, max_area=32 * 48),
        # no size asked: the pipeline's default (256x256 on the tiny VAE) fitted to max_area, as stock does
        dict(image=source(), max_area=32 * 32),
        # a source whose size the pipeline rounds down to the multiple of 4 (43x58 -> 40x56)
        dict(image=source(43, 58, seed=3), height=32, width=32, max_area=1024, negative_prompt="x", true_cfg_scale=3.0),
    ],
    ids=["max_area_fit", "batch", "no_image", "default_size", "rounded_source_cfg"],
)
def test_generate_equals_stock_pipeline(gen, stock, request_):
    request_ = {**BASE, **request_}
    ours = gen.generate(**request_, auto_resize=False, seed=5).frames
    kw = {k: v for k, v in request_.items() if k != "num_outputs_per_prompt"}
    ref = stock_images(
        stock, 5, auto_resize=False, **kw, num_images_per_prompt=request_.get("num_outputs_per_prompt", 1)
    )
    assert ours.shape == ref.shape and ref.std() > 0.01
    assert np.abs(ours - ref).max() <= 1e-5


class Captured(Exception):
    pass


@pytest.mark.parametrize("size", [(40, 56), (300, 100), (64, 64), (90, 200)])
def test_auto_resize_sizes_the_source_as_the_pipeline(gen, stock, size, monkeypatch):
    """With auto_resize (the default), the source goes to the preferred Kontext resolution nearest its
    aspect ratio (~1 megapixel): the preprocessed pixels equal the stock pipeline's (captured where it
    encodes them; a megapixel reference is too large to denoise on the tiny CPU model)."""
    image = source(*size, seed=size[0])
    seen = {}

    def capture(image, *args, **kwargs):
        seen["pixels"] = image
        raise Captured

    monkeypatch.setattr(stock, "prepare_latents", capture)
    with pytest.raises(Captured):
        stock(image=image, prompt="x", height=32, width=32, max_area=1024, num_inference_steps=1)
    stage = gen.pipeline.stages[0]
    pixels = stage.source_pixels(SamplingParams(prompt="x", image=[image], extra={"auto_resize": True}))
    assert pixels.shape == seen["pixels"].shape and pixels.shape[-2] * pixels.shape[-1] > 600_000
    assert torch.equal(pixels, seen["pixels"])
    kept = stage.source_pixels(SamplingParams(prompt="x", image=[image], extra={"auto_resize": False}))
    assert kept.shape[-2:] == (size[0] // 4 * 4, size[1] // 4 * 4)


def test_a_size_the_pipeline_would_change_is_refused_naming_max_area(gen):
    with pytest.raises(
        RequestError,
        match=r"max_area=1048576: FluxKontextPipeline would generate 1024x1024, not the "
        r"asked 32x32 .* give max_area=1024 to keep 32x32, or ask height=1024, width=1024",
    ) as err:
        gen.generate(**BASE, image=source(), height=32, width=32, auto_resize=False)
    assert err.value.field == "max_area"


@pytest.mark.parametrize(
    "kwargs,match,field",
    [
        (dict(image=[source(), source()]), r"image: flux_kontext takes 0 to 1 conditioning image\(s\); got 2", "image"),
        (dict(image=source(3, 3)), r"image is 3x3 pixels: FluxKontextPipeline needs at least 4 on each side", "image"),
        (dict(auto_resize="no"), r"auto_resize must be a bool for flux_kontext; got 'no'", "auto_resize"),
        (dict(max_area=0), r"max_area must be >= 1 for flux_kontext; got 0", "max_area"),
    ],
)
def test_bad_sources_and_sizing_options_are_request_errors(gen, kwargs, match, field):
    request = {**BASE, "image": source(), "height": 32, "width": 32, "max_area": 1024, "auto_resize": False, **kwargs}
    with pytest.raises(RequestError, match=match) as err:
        gen.generate(**request)
    assert err.value.field == field


def test_image_as_path_array_or_pil_is_the_same_image(gen, tmp_path):
    image = source(seed=9)
    image.save(tmp_path / "src.png")
    request = {**BASE, "height": 32, "width": 32, "max_area": 1024, "auto_resize": False, "seed": 1}
    frames = [gen.generate(**request, image=x).frames for x in (image, str(tmp_path / "src.png"), np.asarray(image))]
    assert np.array_equal(frames[0], frames[1]) and np.array_equal(frames[0], frames[2])


def test_cli_generate_with_image_equals_stock(spindle_cli, stock, tiny_flux_kontext, tmp_path):
    from PIL import Image

    image = source(seed=4)
    image.save(tmp_path / "src.png")
    out = tmp_path / "out.png"
    result = spindle_cli(
        "generate", "--model", tiny_flux_kontext, "--prompt", BASE["prompt"], "--image", tmp_path / "src.png",
        "--height", 32, "--width", 48, "--max-area", 32 * 48, "--auto-resize", "false", "--steps", 2,
        "--guidance", 2.5, "--seed", 3, "--out", out, "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "family flux_kontext" in result.stdout
    request = {**BASE, "max_sequence_length": 512}  # the CLI's: the pipeline's default
    ref = stock_images(stock, 3, auto_resize=False, **request, image=image, height=32, width=48, max_area=32 * 48)[0]
    written = np.asarray(Image.open(out)).astype(np.float32) / 255
    assert written.shape == ref.shape and np.abs(written - ref).max() <= 1 / 255 + 1e-6
    bad = spindle_cli("generate", "--model", tiny_flux_kontext, "--prompt", "x", "--out", out, "--height", 32,
                      "--width", 32, "--image", tmp_path / "src.png")  # fmt: skip
    assert bad.returncode == 2 and "max_area=1048576" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"sp": 2}, {"cfg_parallel": True}], ids=["sp2", "cfg_parallel"])
def test_sp_and_cfg_parallel_equal_one_process(gen, tiny_flux_kontext, options, tmp_path):
    """Ulysses SP splits the latents' and the source's tokens together; CFG-parallel runs one branch a rank."""
    from spindle.testing.multiprocess import generate_on_ranks

    source(seed=6).save(tmp_path / "src.png")
    kw = {**BASE, "image": str(tmp_path / "src.png"), "height": 32, "width": 48, "max_area": 32 * 48}
    kw.update(auto_resize=False, negative_prompt="blurry", true_cfg_scale=3.0, seed=2)
    single = gen.generate(**kw).frames
    frames, _ = generate_on_ranks(tiny_flux_kontext, options, kw, tmp_path)
    for rank_frames in frames:
        assert np.abs(rank_frames - single).max() <= 1e-5
