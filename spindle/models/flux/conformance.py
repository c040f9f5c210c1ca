"""FLUX.1's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec

FLUX = ConformanceSpec(
    # Flux's guidance_scale is embedded guidance; classifier-free guidance is true_cfg_scale
    parity_cases=shared.parity_cases(
        cfg=dict(guidance_scale=3.5, true_cfg_scale=4.0, seed=7),
        nocfg=dict(guidance_scale=4.0, seed=0),
        max_sequence_length=16,
    ),
    # FluxPipeline's: no true CFG by default
    default_params=shared.image_default_params(1.0, num_frames=None, num_inference_steps=28, guidance_scale=3.5),
    request_errors=(
        shared.multiple_error("height", 30, 4, "28 or 32", why=shared.PACKING),
        shared.multiple_error("width", 2, 4, "4"),
        shared.text_length_error(512),
    ),
    # the embedded --guidance flag
    cli_case=dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=3.5, seed=4),
)
