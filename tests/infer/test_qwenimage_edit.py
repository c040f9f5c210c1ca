"""Qwen-Image-Edit families (`qwenimage_edit`: QwenImageEditPipeline; `qwenimage_edit_plus`:
QwenImageEditPlusPipeline), what the conformance suite does not cover.

How the reference is obtained: the stock pipelines take a `transformers.Qwen2VLProcessor`, which
transformers refuses to build here (its video processor needs torchvision, which this machine does not
have and Spindle never depends on). The references are the *stock* pipeline classes, unmodified,
loaded by `from_pretrained(root, processor=...)` with the processor assembled from the checkpoint's
own tokenizer and the PIL backend of Qwen2-VL's image processor
(`spindle.models.qwenimage_edit.processor.stock_components`): `Qwen2VLProcessor.__call__` itself, on a
subclass that declares no video processor. `test_stock_processor_still_needs_torchvision` fails
once transformers builds the stock processor here, and the workaround can go.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.models.qwenimage_edit.conformance import sample_image
from spindle.testing.conformance import PARITY_ATOL, check_request_error, stock_pipeline


@pytest.fixture(scope="module")
def edit(tiny_checkpoint):
    return tiny_checkpoint("qwenimage_edit")


@pytest.fixture(scope="module")
def plus(tiny_checkpoint):
    return tiny_checkpoint("qwenimage_edit_plus")


def stock(root, **kwargs):
    pipe = stock_pipeline(root)
    pipe.set_progress_bar_config(disable=True)
    seed = kwargs.pop("seed")
    return pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="np").images


def test_stock_processor_still_needs_torchvision(edit):
    """Why the processor is assembled (the canary of the workaround)."""
    from transformers import Qwen2VLProcessor

    with pytest.raises(ImportError, match=r"(?i)torchvision"):
        Qwen2VLProcessor.from_pretrained(edit / "processor")


def test_tiny_layout_processor_and_template_prefix(edit):
    """model_index.json names the real processor class; the tokenizer splits the edit template's system
    prefix into the 64 tokens the pipelines drop (as the real Qwen2 tokenizer does), so what is kept
    starts with the image's vision tokens, which the processor expanded to the image's token count."""
    index = json.loads((edit / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    pipe = stock_pipeline(edit)
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    ids = pipe.tokenizer(prefix).input_ids
    assert len(ids) == pipe.prompt_template_encode_start_idx == 64 and pipe.tokenizer.unk_token_id not in ids
    image = pipe.image_processor.resize(sample_image(), 864, 1216)
    inputs = pipe.processor(
        text=[pipe.prompt_template_encode.format("make it red")], images=[image], return_tensors="pt"
    )
    kept = pipe.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0][64:].tolist())
    grid = inputs["image_grid_thw"][0]
    vision = int(grid.prod()) // 4  # 2x2 merge
    assert kept[0] == "<|vision_start|>" and kept[1 : 1 + vision] == ["<|image_pad|>"] * vision
    assert kept[1 + vision : 5 + vision] == ["<|vision_end|>", "make", "it", "red"]


def test_the_size_follows_the_input_image_as_in_the_pipeline(edit):
    """No height/width: the pipeline's own size, the image's at 1024x1024 pixels (56x40 -> 1216x864);
    Spindle's image equals the stock pipeline's at that size."""
    kw = dict(prompt="make the circle red", image=sample_image(), num_inference_steps=2, seed=1)
    reference = stock(edit, **kw)
    assert reference.shape == (1, 864, 1216, 3)
    frames = load_generator(edit).generate(**kw).frames
    assert float(np.abs(frames - reference).max()) <= PARITY_ATOL


def test_plus_takes_several_images_and_each_counts(plus):
    gen = load_generator(plus)
    kw = dict(prompt="put the circle on the square", height=32, width=32, num_inference_steps=2, seed=2)
    kw |= dict(image_area=64 * 64, condition_image_area=32 * 32)
    both = gen.generate(image=[sample_image(), sample_image(48, 32, seed=1)], **kw).frames
    first = gen.generate(image=[sample_image()], **kw).frames
    swapped = gen.generate(image=[sample_image(48, 32, seed=1), sample_image()], **kw).frames
    # (the tiny random VAE decodes near-grey whatever the latents: each change is still past what parity resolves)
    assert np.abs(both - first).max() > 10 * PARITY_ATOL and np.abs(both - swapped).max() > PARITY_ATOL


def test_image_requests_are_clear_errors(edit, plus):
    gen = load_generator(edit)
    base = dict(prompt="make it red", height=32, width=32, num_inference_steps=2, seed=0)
    check_request_error(gen, base, r"image is required for qwenimage_edit: give 1 conditioning image", "image")
    check_request_error(
        gen, {**base, "image": [sample_image()] * 2}, r"image: qwenimage_edit takes 1 conditioning image\(s\); got 2"
    )
    check_request_error(
        load_generator(plus), {**base, "image": [sample_image()] * 4}, r"qwenimage_edit_plus takes 1 to 3 conditioning"
    )
    check_request_error(
        gen,
        {**base, "image": sample_image(), "image_area": 10},
        r"image_area must be between 1024 and 4194304 for qwenimage_edit; got 10",
    )


def test_generate_cli_several_images_and_one_line_errors(plus, tmp_path, spindle_cli):
    from PIL import Image

    paths = []
    for i, image in enumerate([sample_image(), sample_image(48, 32, seed=1)]):
        image.save(tmp_path / f"in{i}.png")
        paths += ["--image", str(tmp_path / f"in{i}.png")]
    common = ["generate", "--model", str(plus), "--prompt", "a fox", "--steps", "2", "--seed", "3"]
    size = ["--height", "32", "--width", "32", "--image-area", "4096", "--condition-image-area", "1024"]
    r = spindle_cli(*common, *size, *paths, "--out", str(tmp_path / "out.png"))
    assert r.returncode == 0, r.stderr
    png = np.asarray(Image.open(tmp_path / "out.png"))
    frames = load_generator(plus).generate(
        prompt="a fox", image=[str(tmp_path / "in0.png"), str(tmp_path / "in1.png")], height=32, width=32,
        num_inference_steps=2, seed=3, image_area=4096, condition_image_area=1024,
    ).frames  # fmt: skip
    assert np.abs(png.astype(np.float32) - frames[0] * 255).max() <= 1.0
    r = spindle_cli(*common, *size, "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error: --image is required for qwenimage_edit_plus: give 1 conditioning image(s) (--image PATH)" in r.stderr


def test_several_prompts_in_one_request(plus):
    """The pipelines take one prompt (Plus refuses more); Spindle encodes each prompt with the images and
    pads them to one length with masked zeros: the first sample equals that prompt's request alone (the
    noise of sample 0 is the first draw of the same generator)."""
    gen = load_generator(plus)
    kw = dict(image=[sample_image()], height=32, width=32, num_inference_steps=2, seed=5, image_area=64 * 64)
    both = gen.generate(prompt=["make the circle red", "a square"], **kw).frames
    alone = gen.generate(prompt="make the circle red", **kw).frames
    assert both.shape[0] == 2 and float(np.abs(both[0] - alone[0]).max()) <= PARITY_ATOL


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [{"sp": 2}, {"ring": 2}, {"cfg_parallel": True}], ids=["sp2", "ring2", "cfg_parallel"]
)
def test_multiprocess_equals_single_process(plus, tmp_path, options):
    """Ulysses SP=2 and ring attention ring=2 split the one sequence of output and reference tokens (2 +
    4 of each of two images at these sizes) and the masked text; CFG-parallel runs the two branches on two
    processes: each equals one process."""
    from spindle.testing.multiprocess import generate_on_ranks

    paths = []
    for i, image in enumerate([sample_image(), sample_image(48, 32, seed=1)]):
        image.save(tmp_path / f"in{i}.png")
        paths.append(str(tmp_path / f"in{i}.png"))
    kw = dict(
        prompt="make the circle red", negative_prompt="blurry", true_cfg_scale=3.0, image=paths, height=32,
        width=64, num_inference_steps=2, seed=21, image_area=64 * 64, condition_image_area=32 * 32,
    )  # fmt: skip
    exact = load_generator(plus).generate(**kw).frames
    frames, _ = generate_on_ranks(plus, options, kw, tmp_path)
    for rank_frames in frames:
        np.testing.assert_allclose(rank_frames, exact, atol=1e-5, rtol=0)
