"""Step caches (diffusers hooks behind `cache=NAME`): each one skips work, resets between requests, and
`cache="auto"` picks the fastest policy that keeps the PSNR floor."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.models.wan.tiny import build_tiny as build_tiny_wan

A = dict(
    prompt="a paper boat on a river",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=8,
    guidance_scale=4.0,
    seed=3,
)
B = {**A, "prompt": "a lighthouse in a storm", "seed": 11}
# Aggressive knobs so that every policy approximates something within 8 steps.
POLICY_KNOBS = {
    "fbc": (1e6, {}),
    "mag": (10.0, {"mag_ratios": [1.0] * 8, "retention_ratio": 0.1}),
    "taylorseer": (3, {"disable_cache_before_step": 1}),
    "pab": (3, {"spatial_attention_timestep_skip_range": (-1, 1001)}),
    "faster": (3, {"spatial_attention_timestep_skip_range": (-1, 1001), "unconditional_batch_skip_range": 2}),
}


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("wan_caches"), seed=1, transformer={"num_layers": 4})


@pytest.fixture(scope="module")
def gen(deep):

    return load_generator(deep)


@pytest.fixture(scope="module")
def uncached(gen):
    gen.pipeline.denoising.set_cache(None)
    return {"A": gen.generate(**A).frames, "B": gen.generate(**B).frames}


@pytest.mark.parametrize("name", sorted(POLICY_KNOBS))
def test_cache_resets_between_requests(gen, uncached, name):
    """B after A equals B on a fresh cache (the server interleaves requests); the cache did approximate."""
    threshold, options = POLICY_KNOBS[name]
    stage = gen.pipeline.denoising
    stage.set_cache(name, threshold, options)
    try:
        fresh_b = gen.generate(**B).frames
        gen.generate(**A)
        b_after_a = gen.generate(**B).frames
    finally:
        stage.set_cache(None)
    np.testing.assert_array_equal(b_after_a, fresh_b)
    assert not np.allclose(fresh_b, uncached["B"], atol=1e-6, rtol=0), f"{name} skipped nothing"


def test_mag_without_ratios_calibrates_on_the_first_request(gen, uncached):
    """The first request measures MagCache's ratios without skipping (exact); later ones skip with them."""
    stage = gen.pipeline.denoising
    stage.set_cache("mag", 10.0, {"retention_ratio": 0.1})
    try:
        first = gen.generate(**A).frames
        ratios = stage.cache.mag_ratios
        second = gen.generate(**A).frames
    finally:
        stage.set_cache(None)
    np.testing.assert_array_equal(first, uncached["A"])
    assert ratios is not None and len(ratios) == A["num_inference_steps"]
    assert not np.allclose(second, uncached["A"], atol=1e-6, rtol=0)


def test_auto_picks_the_fastest_policy_above_the_floor(deep, uncached):
    from spindle.infer import psnr

    gen = load_generator(deep, cache="auto", min_psnr=30.0)
    out = gen.generate(**A).frames  # calibrates on this request, then runs it with the choice
    choice = gen.cache_choice
    assert choice is not None and choice.name is not None
    passing = [t for t in choice.trials if 30.0 <= t["psnr"] < float("inf")]  # inf: skipped nothing
    assert choice.seconds == min(t["seconds"] for t in passing)
    assert {t["name"] for t in choice.trials} >= {"fbc", "taylorseer", "pab"}
    assert psnr(out, uncached["A"]) >= 30.0
    assert gen.pipeline.denoising.cache.name == choice.name
    assert f"chose {choice.name}" in choice.describe()


def test_auto_with_an_unreachable_floor_runs_uncached(deep, uncached):

    gen = load_generator(deep, cache="auto", min_psnr=1000.0)
    out = gen.generate(**A).frames
    assert gen.cache_choice.name is None and gen.pipeline.denoising.cache is None
    assert "no policy" in gen.cache_choice.describe()
    np.testing.assert_allclose(out, uncached["A"], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_compile_cache_and_cfg_batching_together_match_eager(deep, gen, uncached):
    """Regional compile + first-block cache + CFG batching vs the same cache in eager mode."""
    from spindle.infer import psnr

    gen.pipeline.denoising.set_cache("fbc", 0.2)
    try:
        eager = gen.generate(**A).frames
    finally:
        gen.pipeline.denoising.set_cache(None)
    fast = load_generator(deep, compile=True, cache="fbc", cache_threshold=0.2, cfg_batch=True)
    out = fast.generate(**A).frames
    assert psnr(out, eager) >= 40.0  # float rounding of the compiled blocks may flip a skip decision
    assert psnr(out, uncached["A"]) >= 30.0


def test_faster_cache_needs_a_spatial_output_and_auto_skips_it_for_packed_tokens(tiny_checkpoint):
    """FasterCache splits the model output into 2-D frequencies: Flux's output is packed tokens
    [B, S, C], so `cache="faster"` is a clear error there and `auto` calibrates without it (it used to
    crash mid-calibration inside diffusers' hook on a 5-D permute)."""

    flux = tiny_checkpoint("flux")
    with pytest.raises(ValueError, match=r"'faster'.*flux's transformer outputs packed tokens"):
        load_generator(flux, cache="faster")
    gen = load_generator(flux, cache="auto", min_psnr=30.0)
    gen.generate(prompt="a red fox", negative_prompt="blurry", true_cfg_scale=4.0, height=32, width=32,
                 num_inference_steps=6, seed=0)  # fmt: skip
    tried = {t["name"] for t in gen.cache_choice.trials}
    assert "faster" not in tried and {"fbc", "taylorseer"} <= tried


def test_faster_cache_without_cfg_batch_is_refused_before_and_after_loading(tiny_wan):
    """FasterCache approximates the unconditional half of a CFG-batched forward. The engine options
    refuse it without CFG batching before anything loads, and the denoising stage (a cache set on an
    engine built without it; what `auto` skips) says the same, from one definition."""

    message = "cache='faster' approximates the unconditional half of a CFG-batched forward"
    with pytest.raises(ValueError, match=message):
        load_generator(tiny_wan, cache="faster", cfg_batch=False)
    stage = load_generator(tiny_wan, cfg_batch=False).pipeline.denoising
    assert stage.cache_unavailable("faster").startswith(message)
    with pytest.raises(ValueError, match=message):
        stage.set_cache("faster")
    assert stage.cache is None
    stage.cfg_batch = True  # the same stage with CFG batching takes it
    assert stage.cache_unavailable("faster") is None
