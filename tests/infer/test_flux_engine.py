"""Flux through the multi-process engine options: Ulysses SP (--sp 2, through FluxTransformer2DModel's
`_cp_plan`) and CFG parallel over real processes. (First-block cache and regional compile: every
family in tests/conformance/test_conformance.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from spindle.api import load_generator
from spindle.models.flux.tiny import build_tiny as build_tiny_flux
from spindle.testing.multiprocess import generate_on_ranks
from tests.conftest import FLUX_TRUE_CFG, generate_on_sp2_ranks

KW = FLUX_TRUE_CFG  # true CFG, so the CFG modes have two branches to split


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """2 double-stream + 2 single-stream blocks."""
    return build_tiny_flux(
        tmp_path_factory.mktemp("flux_deep"), seed=1, transformer={"num_layers": 2, "num_single_layers": 2}
    )


@pytest.fixture(scope="module")
def exact(deep):

    return load_generator(deep).generate(**KW).frames


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
    r = generate_on_sp2_ranks(deep, out, "--height", 32, "--width", 48, "--steps", 2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert np.asarray(Image.open(out)).shape == (32, 48, 3)
