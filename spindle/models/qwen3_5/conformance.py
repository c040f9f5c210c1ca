"""Qwen3.5's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

QWEN3_5 = CausalLMConformanceSpec(parallel=("dp_shard2", "sp2"))
