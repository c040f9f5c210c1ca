"""Z-Image's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec
from spindle.models.z_image import MAX_SEQUENCE_LENGTH

Z_IMAGE = ConformanceSpec(
    parity_cases=shared.parity_cases(
        cfg=dict(guidance_scale=4.0, seed=7),
        nocfg=dict(guidance_scale=0.0, seed=0),  # Z-Image-Turbo's setting
        max_sequence_length=16,
    ),
    # ZImageTransformer2DModel has no `_cp_plan` (it takes lists of variable-length samples)
    sequence_parallel=(),
    # ZImagePipeline.__call__ defaults: 1024x1024 whatever the VAE, guidance 5 (CFG with "")
    default_params=dict(
        height=1024, width=1024, num_inference_steps=50, guidance_scale=5.0, max_sequence_length=512, extra={}
    ),
    stock_size=1024,  # ZImagePipeline.__call__'s `height or 1024` (it has no default_sample_size)
    request_errors=(
        shared.multiple_error("height", 30, 16, "16 or 32", why="VAE x8 x 2x2 packing"),
        shared.text_length_error(MAX_SEQUENCE_LENGTH),
    ),
    cli_case=dict(prompt="a cat", height=32, width=48, num_inference_steps=2, guidance_scale=2.0, seed=4),
)
