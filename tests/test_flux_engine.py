"""Flux through every engine option Wan has: first-block cache, regional torch.compile, Ulysses SP
(--sp 2, through FluxTransformer2DModel's `_cp_plan`) and CFG parallel over real processes."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.testing.multiprocess import generate_on_ranks
from spindle.testing.tiny import build_tiny_flux
from tests.conftest import generate_with_sp2

# true CFG (negative prompt + true_cfg_scale) so the CFG modes have two branches to split
KW = dict(
    prompt="a windmill at sunset",
    negative_prompt="blurry",
    height=32,
    width=48,
    num_inference_steps=3,
    guidance_scale=3.5,
    max_sequence_length=16,
    seed=21,
    true_cfg_scale=3.0,
)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """2 double-stream + 2 single-stream blocks, so that skipped blocks show clearly."""
    return build_tiny_flux(
        tmp_path_factory.mktemp("flux_deep"), seed=1, transformer={"num_layers": 2, "num_single_layers": 2}
    )


@pytest.fixture(scope="module")
def exact(deep):
    from spindle import DiffusionGenerator

    return DiffusionGenerator.from_pretrained(deep).generate(**KW).frames


def count_block_calls(gen) -> list[int]:
    """Real block computations (attention calls of both block kinds; a cached block skips them)."""
    calls = [0]
    t = gen.transformer
    for block in [*t.transformer_blocks, *t.single_transformer_blocks]:
        block.attn.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
def test_cache_threshold_zero_is_exact(deep, exact, cfg_batch):
    from spindle import DiffusionGenerator

    gen = DiffusionGenerator.from_pretrained(deep, cache="fbc", cache_threshold=0.0, cfg_batch=cfg_batch)
    calls = count_block_calls(gen)
    out = gen.generate(**KW).frames
    forwards = KW["num_inference_steps"] * (1 if cfg_batch else 2)
    assert calls[0] == 4 * forwards
    np.testing.assert_allclose(out, exact, atol=1e-5, rtol=0)


def test_cache_large_threshold_skips_blocks(deep, exact):
    from spindle import DiffusionGenerator
    from spindle.infer import psnr

    gen = DiffusionGenerator.from_pretrained(deep, cache="fbc", cache_threshold=1e6)
    calls = count_block_calls(gen)
    out = gen.generate(**KW).frames
    assert calls[0] == 4 + 2  # step 0: all 4 blocks; steps 1-2: the first block only
    value = psnr(out, exact)
    assert np.isfinite(value) and value > 5.0
    calls[0] = 0
    np.testing.assert_array_equal(gen.generate(**KW).frames, out)  # cache state reset per request
    assert calls[0] == 6


@pytest.mark.slow
def test_compile_matches_eager(deep, exact):
    from spindle import DiffusionGenerator

    gen = DiffusionGenerator.from_pretrained(deep, compile=True)
    t = gen.transformer
    assert all(
        getattr(b, "_compiled_call_impl", None) is not None
        for b in [*t.transformer_blocks, *t.single_transformer_blocks]
    )
    np.testing.assert_allclose(gen.generate(**KW).frames, exact, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{"sp": 2}, {"cfg_parallel": True}], ids=["sp2", "cfg_parallel"])
def test_multiprocess_equals_single_process(deep, exact, tmp_path, options):
    frames, _ = generate_on_ranks(deep, options, KW, tmp_path)
    for rank_frames in frames:
        np.testing.assert_allclose(rank_frames, exact, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_cli_nproc_sp_writes_png(deep, tmp_path):
    from PIL import Image

    out = tmp_path / "sp.png"
    r = generate_with_sp2(deep, out)
    assert r.returncode == 0, r.stderr[-4000:]
    assert np.asarray(Image.open(out)).shape == (32, 48, 3)
