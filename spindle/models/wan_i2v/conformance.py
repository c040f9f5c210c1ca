"""Wan2.1 I2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import ConformanceSpec, amended, noise_image
from spindle.models.wan.conformance import WAN
from spindle.models.wan_i2v import TEXT_LENGTH

WAN_I2V = ConformanceSpec(
    # Wan's cases with the seeded conditioning image
    parity_cases=amended(WAN.parity_cases, {"image": noise_image(40, 56)}),
    text_tokens=TEXT_LENGTH,
    default_params=WAN.default_params,
)
