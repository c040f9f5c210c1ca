"""Spindle's staged engine equals stock diffusers WanPipeline for the same seed (fp32 CPU, 1e-5).

The tiny checkpoint's parity cases run in the conformance suite (tests/conformance/test_conformance.py); these
are the Wan-specific second configuration (other sizes, layers, heads, text encoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.models.wan.tiny import build_tiny as build_tiny_wan

TOL = 1e-5


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A second random config: other sizes, 3 layers, 8 heads x 8, wider text encoder."""
    return build_tiny_wan(
        tmp_path_factory.mktemp("wan_other"),
        seed=3,
        transformer={"num_layers": 3, "num_attention_heads": 8, "attention_head_dim": 8, "ffn_dim": 96},
        text_encoder={"d_model": 48, "num_heads": 4, "d_kv": 12},
    )


def diffusers_frames(root, **kw) -> np.ndarray:
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    seed = kw.pop("seed")
    return pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="np").frames


CASES = {
    "other_cfg": (
        "other",
        dict(
            prompt="waves at dusk",
            negative_prompt="low quality, static",
            height=48,
            width=32,
            num_frames=9,
            num_inference_steps=3,
            guidance_scale=3.5,
            seed=123,
        ),
    ),
    "other_nocfg": (
        "other",
        dict(
            prompt="waves at dusk", height=16, width=32, num_frames=1, num_inference_steps=2, guidance_scale=0.0, seed=5
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cfg_batch", [False, True], ids=["two_forwards", "cfg_batch"])
def test_frames_equal_diffusers(case, cfg_batch, request):

    which, kw = CASES[case]
    root = request.getfixturevalue(which)
    ref = diffusers_frames(root, **kw)
    gen = load_generator(root, cfg_batch=cfg_batch)
    result = gen.generate(**kw)
    assert result.frames.dtype == np.float32
    assert result.frames.shape == ref.shape
    assert 0.0 <= result.frames.min() and result.frames.max() <= 1.0
    np.testing.assert_allclose(result.frames, ref, atol=TOL, rtol=0)
    assert set(result.timings) == {"before_denoising", "denoising", "decoding"}


# One batched CFG forward per step equal to two: tests/conformance/test_conformance.py::test_cfg_batch_is_one_forward_equal_to_two


def test_batch_of_prompts_and_outputs_per_prompt(tiny_wan):
    from diffusers import WanPipeline

    kw = dict(
        prompt=["a cat", "a dog"],
        negative_prompt=["dark", "noisy"],
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=2.0,
    )
    pipe = WanPipeline.from_pretrained(tiny_wan)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(**kw, num_videos_per_prompt=2, generator=torch.Generator().manual_seed(11), output_type="np").frames
    out = load_generator(tiny_wan).generate(**kw, num_outputs_per_prompt=2, seed=11)
    assert out.frames.shape == ref.shape == (4, 5, 32, 32, 3)
    np.testing.assert_allclose(out.frames, ref, atol=TOL, rtol=0)
