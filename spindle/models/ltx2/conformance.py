"""LTX-2's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.ltx2 import GUIDANCE_OPTIONS, MAX_SEQUENCE_LENGTH, PLAIN_CFG
from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import ConformanceSpec

LTX2 = ConformanceSpec(
    parity_cases={
        **shared.parity_cases(
            cfg=dict(num_frames=5, guidance_scale=3.0, height=64, width=64, seed=0, **PLAIN_CFG),
            nocfg=dict(num_frames=9, height=64, width=64, guidance_scale=1.0, audio_guidance_scale=1.0, seed=7)
            | PLAIN_CFG,
            max_sequence_length=16,
        ),
        # the pipeline's default guidance (CFG 3 / audio 7, STG, modality isolation, rescale) at 64x64, 9 frames
        "defaults": dict(prompt=shared.PROMPT, height=64, width=64, num_frames=9, num_inference_steps=2, seed=3),
    },
    sequence_parallel=("ulysses2",),
    # 17 frames: 9 latent frames x 8 x 8 = 576 video tokens and round(17 / 24 x 25) = 18 audio tokens, both even
    # (the demo's 9 give 9 audio tokens)
    sequence_parallel_frames=17,
    default_params=dict(
        height=512,
        width=768,
        num_frames=121,
        num_inference_steps=30,
        guidance_scale=3.0,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        extra={o.name: o.default for o in GUIDANCE_OPTIONS},
    ),
    request_errors=(
        shared.multiple_error("height", 40, 32, "32 or 64"),
        shared.multiple_error("width", 72, 32, "64 or 96"),
        (dict(num_frames=6), r"num_frames must be 2k\+1 \(1, 3, 5, 7, \.\.\.\).*got 6.*try 5 or 7"),
        shared.text_length_error(MAX_SEQUENCE_LENGTH),
    ),
)
