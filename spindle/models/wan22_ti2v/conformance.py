"""Wan2.2 TI2V-5B's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import ConformanceSpec, amended, multiple_error
from spindle.models.wan.conformance import NUM_FRAMES_ERROR, WAN

WAN22_TI2V = ConformanceSpec(
    # text-to-video through the folder's own pipeline (WanPipeline); image-to-video against stock
    # WanImageToVideoPipeline on the same folder: tests/infer/test_wan22_ti2v.py. Wan's cases, 32 pixels
    # a side per token: the no-CFG one 32x64
    parity_cases=amended(WAN.parity_cases, {"width": 64}, only="nocfg"),
    request_errors=(
        multiple_error("height", 48, 32, "32 or 64"),
        multiple_error("width", 40, 32, "32 or 64"),
        NUM_FRAMES_ERROR,
    ),
    default_params=WAN.default_params,
)
