"""Speed options keep their promises: step caching (diffusers first-block cache) and regional compile."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from spindle.testing.tiny import build_tiny_wan

KW = dict(
    prompt="a paper boat on a river",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=5,
    num_inference_steps=4,
    guidance_scale=4.0,
    seed=3,
)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """4 blocks, so that skipped blocks show clearly."""
    return build_tiny_wan(tmp_path_factory.mktemp("wan_deep"), seed=1, transformer={"num_layers": 4})


@pytest.fixture(scope="module")
def exact(deep):
    from spindle import DiffusionGenerator

    return DiffusionGenerator.from_pretrained(deep).generate(**KW).frames


def count_block_calls(gen) -> list[int]:
    """Counts real block computations (self-attention calls; a cached block skips them)."""
    calls = [0]
    for block in gen.transformer.blocks:
        block.attn1.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
def test_cache_threshold_zero_is_exact(deep, exact, cfg_batch):
    from spindle import DiffusionGenerator

    gen = DiffusionGenerator.from_pretrained(deep, cache="fbc", cache_threshold=0.0, cfg_batch=cfg_batch)
    calls = count_block_calls(gen)
    out = gen.generate(**KW).frames
    forwards = KW["num_inference_steps"] * (1 if cfg_batch else 2)
    assert calls[0] == 4 * forwards  # every block ran
    np.testing.assert_allclose(out, exact, atol=1e-5, rtol=0)


def test_cache_large_threshold_skips_blocks_and_reports_psnr(deep, exact):
    from spindle import DiffusionGenerator
    from spindle.infer import psnr

    gen = DiffusionGenerator.from_pretrained(deep, cache="fbc", cache_threshold=1e6)
    calls = count_block_calls(gen)
    out = gen.generate(**KW).frames
    # step 0 computes all 4 blocks (nothing cached yet); steps 1-3 run only the first block
    assert calls[0] == 4 + 3
    value = psnr(out, exact)
    assert np.isfinite(value) and 5.0 < value < 80.0  # lossy, but the same video
    # the cache state is reset per request: a second request behaves the same
    calls[0] = 0
    again = gen.generate(**KW).frames
    assert calls[0] == 7
    np.testing.assert_array_equal(again, out)
    assert psnr(exact, exact) == float("inf")


def test_cli_cache_reports_psnr(deep, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "spindle",
            "generate",
            "--model",
            str(deep),
            "--prompt",
            "a boat",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "5",
            "--steps",
            "3",
            "--seed",
            "0",
            "--cache",
            "fbc",
            "--cache-threshold",
            "0.5",
            "--quiet",
            "--out",
            str(tmp_path / "c.mp4"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "PSNR" in r.stdout and "dB vs uncached" in r.stdout


@pytest.mark.slow
def test_compile_matches_eager(deep, exact):
    """Regional torch.compile of the repeated blocks (CPU inductor: slow to compile, so one tiny run)."""
    from spindle import DiffusionGenerator

    gen = DiffusionGenerator.from_pretrained(deep, compile=True)
    blocks = gen.transformer.blocks
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    out = gen.generate(**KW).frames
    np.testing.assert_allclose(out, exact, atol=1e-4, rtol=0)
