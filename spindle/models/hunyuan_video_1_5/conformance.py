"""HunyuanVideo-1.5's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.hunyuan_video_1_5 import MAX_SEQUENCE_LENGTH
from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec

HUNYUAN_VIDEO_1_5 = ConformanceSpec(
    # guidance_scale is the stock pipeline's guider's (`stock_guider`); 16-pixel multiples (VAE x16)
    parity_cases=shared.parity_cases(
        cfg=dict(num_frames=5, guidance_scale=6.0, seed=0, prompt='a sign that says "open"'),
        nocfg=dict(num_frames=9, height=64, width=64, guidance_scale=1.0, seed=7),
    ),
    stock_guider=("guidance_scale",),
    # HunyuanVideo15Transformer3DModel has no `_cp_plan`, and it regroups each sample's text tokens (valid ones
    # first) in its forward, so a sequence split before the blocks has nothing to shard by
    sequence_parallel=(),
    # HunyuanVideo15Pipeline.__call__ defaults; the size is its 16:9 bucket at the transformer's target_size (the
    # tiny's 64: 48x80), guidance the checkpoint guider's (the tiny's 6)
    default_params=dict(
        height=48, width=80, num_frames=121, num_inference_steps=50, guidance_scale=6.0, max_sequence_length=1000
    ),
    stock_size=(48, 80),
    request_errors=(
        shared.multiple_error("height", 40, 16, "32 or 48"),
        shared.multiple_error("width", 24, 16, "16 or 32"),
        (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
        shared.text_length_error(MAX_SEQUENCE_LENGTH),
    ),
)
