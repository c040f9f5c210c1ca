"""LTX-2 I2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

import dataclasses

from spindle.models.ltx2 import GUIDANCE_OPTIONS
from spindle.models.ltx2.conformance import LTX2 as T2V
from spindle.models.ltx2_i2v import IMAGE_CRF
from spindle.models.shared.conformance import noise_image

# x264's output is not bit-reproducible under load (spindle.data.media.write_video), so the parity cases condition on
# the image as given (image_crf=0); the CRF path is the pipeline's own helper, called alike by both
CASE = dict(image=noise_image(64, 64), image_crf=0)

LTX2_I2V = dataclasses.replace(
    T2V,
    parity_cases={name: dict(case, **CASE) for name, case in T2V.parity_cases.items()},
    adapter_frames=3,  # (the tiny VAE's 2k+1): the first latent frame is the image, the second shows an adapter
    default_params=dict(T2V.default_params, extra={o.name: o.default for o in (*GUIDANCE_OPTIONS, IMAGE_CRF)}),
)
