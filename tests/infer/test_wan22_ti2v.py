"""Wan2.2 TI2V-5B (family wan22_ti2v: a WanPipeline folder with `expand_timesteps` and the 16x Wan2.2 VAE):
image-to-video equals stock WanImageToVideoPipeline on the same folder (text-to-video parity with the
folder's own WanPipeline is the conformance suite's), the image replaces the first latent frame, and the
size rule follows the VAE's 16x compression x 2x2 patches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.testing import conformance as suite
from spindle.testing.specs import dit_spec

CASES = dit_spec("wan22_ti2v").parity_cases


@pytest.fixture(scope="module")
def tiny_ti2v(tiny_checkpoint):
    return tiny_checkpoint("wan22_ti2v")


def image(seed: int = 0):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8))


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_image_to_video_equals_stock_wan_image_to_video_pipeline(tiny_ti2v, case, cfg_batch):
    from diffusers import WanImageToVideoPipeline

    kwargs = {**CASES[case], "image": image()}
    pipe = WanImageToVideoPipeline.from_pretrained(tiny_ti2v)  # what a diffusers user runs for TI2V's I2V
    pipe.set_progress_bar_config(disable=True)
    stock = {k: v for k, v in kwargs.items() if k != "seed"}
    reference = pipe(**stock, generator=torch.Generator().manual_seed(kwargs["seed"]), output_type="np").frames
    suite.check_reference("wan22_ti2v", reference, kwargs)
    frames = load_generator(tiny_ti2v, cfg_batch=cfg_batch).generate(**kwargs).frames
    assert frames.shape == reference.shape
    np.testing.assert_allclose(frames, reference, atol=suite.PARITY_ATOL, rtol=0)


def test_the_image_conditions_the_first_latent_frame(tiny_ti2v):
    gen = load_generator(tiny_ti2v)
    kwargs = CASES["nocfg"]
    text_only = gen.generate(**kwargs).frames
    first = gen.generate(**kwargs, image=image(1)).frames
    other = gen.generate(**kwargs, image=image(2)).frames
    assert np.abs(first - text_only).max() > 1e-3 and np.abs(first - other).max() > 1e-3
    # the transformer sees the image's tokens at timestep 0 and every other token at the step's timestep
    seen = []
    gen.pipeline.components["transformer"].register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["timestep"]), with_kwargs=True
    )
    gen.generate(**kwargs, image=image(1))
    tokens_per_frame = (32 // 32) * (64 // 32)
    assert seen[0].shape == (1, 3 * tokens_per_frame)  # 9 frames -> 3 latent frames of 1 x 2 tokens
    assert bool((seen[0][:, :tokens_per_frame] == 0).all()) and bool((seen[0][:, tokens_per_frame:] == 1000).all())


def test_folders_forced_on_the_wrong_family_name_the_right_one(tiny_ti2v, tiny_wan):
    with pytest.raises(ValueError, match=r"Wan2\.2 TI2V-5B folder \(expand_timesteps\).* wan22_ti2v family's"):
        load_generator(tiny_ti2v, family="wan")
    with pytest.raises(ValueError, match=r"wan22_ti2v serves Wan2\.2 TI2V-5B folders"):
        load_generator(tiny_wan, family="wan22_ti2v")
