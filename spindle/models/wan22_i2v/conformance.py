"""Wan2.2 A14B I2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import ConformanceSpec
from spindle.models.wan22.conformance import two_expert_conformance
from spindle.models.wan_i2v.conformance import WAN_I2V

# the text at any length too
WAN22_I2V = two_expert_conformance(WAN_I2V, "low_noise", text_tokens=ConformanceSpec.text_tokens)
