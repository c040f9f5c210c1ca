"""Multi-process inference (gloo on CPU, real processes via torchrun) equals the single process:
Ulysses sequence parallelism (--sp 2), ring attention (--ring 2), both on 4 processes (--sp 2 --ring 2)
and CFG parallelism (--cfg-parallel)."""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.testing.multiprocess import generate_on_ranks
from tests.conftest import generate_with_sp2

pytestmark = pytest.mark.slow

KW = dict(
    prompt="a windmill at sunset",
    negative_prompt="blurry",
    height=32,
    width=48,
    num_frames=5,
    num_inference_steps=2,
    guidance_scale=4.5,
    seed=21,
)


@pytest.fixture(scope="module")
def single(tiny_wan):

    return load_generator(tiny_wan).generate(**KW).frames


@pytest.mark.parametrize(
    "options",
    [{"sp": 2}, {"ring": 2}, {"cfg_parallel": True}, {"sp": 2, "ring": 2}],
    ids=["sp2", "ring2", "cfg_parallel", "sp2_ring2"],
)
def test_multiprocess_equals_single_process(tiny_wan, single, tmp_path, options):
    """2 processes, and sp=2 x ring=2 (USP) on 4: every rank's frames equal one process."""
    nproc = options.get("sp", 1) * options.get("ring", 1) * (2 if options.get("cfg_parallel") else 1)
    frames, drawn = generate_on_ranks(tiny_wan, options, KW, tmp_path, nproc=nproc, unseeded=True)
    for rank_frames in frames:
        np.testing.assert_allclose(rank_frames, single, atol=1e-5, rtol=0)
    # no seed given: rank 0 draws one and every rank uses it (same noise on all ranks)
    for rank_drawn in drawn[1:]:
        np.testing.assert_array_equal(drawn[0], rank_drawn)


def test_cli_nproc_sp_writes_mp4(tiny_wan, tmp_path):
    import av

    out = tmp_path / "sp.mp4"
    r = generate_with_sp2(tiny_wan, out, "--num-frames", 5)
    assert r.returncode == 0, r.stderr[-4000:]
    with av.open(str(out)) as c:
        frames = list(c.decode(video=0))
    assert len(frames) == 5 and (frames[0].height, frames[0].width) == (32, 48)


def test_sp_mismatch_is_a_clear_error(tiny_wan):

    with pytest.raises(ValueError, match=r"needs 2 processes, but the world size is 1"):
        load_generator(tiny_wan, sp=2)
