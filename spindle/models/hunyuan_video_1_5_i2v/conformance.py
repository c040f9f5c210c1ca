"""HunyuanVideo-1.5 I2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

import dataclasses

from spindle.models.hunyuan_video_1_5 import MAX_SEQUENCE_LENGTH
from spindle.models.hunyuan_video_1_5.conformance import HUNYUAN_VIDEO_1_5 as T2V
from spindle.models.shared import conformance as shared
from spindle.models.shared.conformance import noise_image

# the stock pipeline's arguments: no height or width (the image's bucket at the transformer's target_size)
CASE = dict(prompt=shared.PROMPT, image=noise_image(40, 56))

HUNYUAN_VIDEO_1_5_I2V = dataclasses.replace(
    T2V,
    parity_cases={
        "cfg": dict(CASE, negative_prompt="blurry", num_frames=5, num_inference_steps=2, guidance_scale=6.0, seed=0),
        "nocfg": dict(CASE, num_frames=9, num_inference_steps=3, guidance_scale=1.0, seed=7),
    },
    # HunyuanVideo15ImageToVideoPipeline.__call__ defaults; the size follows the image
    default_params=dict(T2V.default_params, height=None, width=None),
    stock_size=None,
    request_errors=(
        (dict(height=64), r"height needs width too: give both"),
        (dict(height=40, width=64), r"height must be a positive multiple of 16"),
        (dict(num_frames=6), r"num_frames must be 4k\+1 \(1, 5, 9, 13, \.\.\.\).*got 6.*try 5 or 9"),
        shared.text_length_error(MAX_SEQUENCE_LENGTH),
    ),
)
