"""The default engine is fast *and* within 1e-4 of diffusers; `exact=True` is diffusers bit for bit.

Both families (Wan video, Flux image with true CFG) against their stock diffusers pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spindle.api import load_generator
from spindle.models.flux.tiny import build_tiny as build_tiny_flux
from spindle.models.wan.tiny import build_tiny as build_tiny_wan
from tests.conftest import FLUX_TRUE_CFG

CASES = {
    "wan": dict(
        prompt="a red fox in the snow",
        negative_prompt="blurry",
        height=32,
        width=48,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=5.0,
        seed=4,
    ),
    "flux": FLUX_TRUE_CFG,
}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return {
        "wan": build_tiny_wan(tmp_path_factory.mktemp("wan_defaults"), seed=2, transformer={"num_layers": 3}),
        "flux": build_tiny_flux(tmp_path_factory.mktemp("flux_defaults"), seed=2),
    }


def diffusers_output(root, family: str) -> np.ndarray:
    import diffusers

    kw = dict(CASES[family])
    seed = kw.pop("seed")
    cls = diffusers.WanPipeline if family == "wan" else diffusers.FluxPipeline
    pipe = cls.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="np")
    return out.frames if family == "wan" else out.images


@pytest.fixture(scope="module")
def reference(roots):
    return {family: diffusers_output(root, family) for family, root in roots.items()}


@pytest.mark.parametrize("family", sorted(CASES))
def test_exact_is_bit_identical_to_diffusers(roots, reference, family):

    out = load_generator(roots[family], exact=True).generate(**CASES[family]).frames
    assert out.shape == reference[family].shape
    np.testing.assert_array_equal(out, reference[family])


@pytest.mark.parametrize("family", sorted(CASES))
def test_default_is_within_1e4_of_diffusers(roots, reference, family):

    gen = load_generator(roots[family])
    forwards = []
    gen.transformer.register_forward_pre_hook(
        lambda m, a, k: forwards.append(k["hidden_states"].shape[0]), with_kwargs=True
    )
    out = gen.generate(**CASES[family]).frames
    assert forwards == [2] * CASES[family]["num_inference_steps"]  # CFG batched: one forward of 2 per step
    np.testing.assert_allclose(out, reference[family], atol=1e-4, rtol=0)


def test_wan_default_computes_prompt_projections_once_per_request(roots, reference):
    """Per-request memo: the text projection and cross-attention K/V run once per request, not per step;
    a second request with another prompt recomputes them (nothing leaks across requests)."""

    gen = load_generator(roots["wan"])
    t = gen.transformer
    watched = {
        id(t.condition_embedder.text_embedder.linear_1.weight): "text",
        id(t.blocks[0].attn2.to_k.weight): "to_k",
    }
    calls = {"text": 0, "to_k": 0}

    class CountLinear(TorchFunctionMode):  # counts real matmuls (module hooks fire on memo hits too)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear and id(args[1]) in watched:
                calls[watched[id(args[1])]] += 1
            return func(*args, **(kwargs or {}))

    with CountLinear():
        first = gen.generate(**CASES["wan"]).frames
        assert calls == {"text": 1, "to_k": 1}  # 3 steps, cond + uncond batched: computed once
        other = gen.generate(**{**CASES["wan"], "prompt": "a green field"}).frames
        assert calls == {"text": 2, "to_k": 2}
    assert not np.array_equal(first, other)
    np.testing.assert_allclose(first, reference["wan"], atol=1e-4, rtol=0)


def test_wan_vae_uses_onednn_by_default_not_when_exact(roots):

    def onednn_convs(gen) -> int:
        return sum(
            hasattr(m, "_conv_forward") and "onednn" in m._conv_forward.__qualname__
            for m in gen.pipeline.components["vae"].modules()
        )

    assert onednn_convs(load_generator(roots["wan"])) > 0
    assert onednn_convs(load_generator(roots["wan"], exact=True)) == 0


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(exact=True, cache="fbc"), "exact=True"),
        (dict(exact=True, compile=True), "exact=True"),
        (dict(cache="nope"), "cache must be one of"),
        (dict(cache="fbc", cache_options={"treshold": 1}), "unknown fbc cache option(s) ['treshold']"),
        (dict(cache="taylorseer", cache_threshold=2.5), "cache_interval (an integer)"),
        (dict(cache="faster", cfg_batch=False), "needs cfg_batch=True"),
        (dict(cache_options={"threshold": 1}), "without a cache"),
        (dict(cache="auto", min_psnr=0), "min_psnr"),
    ],
)
def test_bad_engine_options_name_the_option(roots, options, message):

    with pytest.raises(ValueError) as e:
        load_generator(roots["wan"], **options)
    assert message in str(e.value)
