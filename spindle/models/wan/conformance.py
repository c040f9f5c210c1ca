"""Wan2.1 T2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import ConformanceSpec, multiple_error, parity_cases

NUM_FRAMES_ERROR = (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9")

WAN = ConformanceSpec(
    parity_cases=parity_cases(
        cfg=dict(num_frames=5, guidance_scale=5.0, seed=0), nocfg=dict(num_frames=9, guidance_scale=1.0, seed=7)
    ),
    request_errors=(
        multiple_error("height", 30, 16, "16 or 32"),
        multiple_error("width", 40, 16, "32 or 48"),
        (dict(height=0), r"height must be a positive multiple of 16"),
        NUM_FRAMES_ERROR,
        (dict(num_frames=0), r"num_frames must be 4k\+1"),
    ),
    # WanPipeline's __call__ names its size
    default_params=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
)
