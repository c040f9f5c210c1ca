"""Gemma 3 image-text's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

from spindle.models.shared.conformance import CausalLMConformanceSpec

# Ulysses SP refused (above): FSDP2 / HSDP layouts only
GEMMA3_VL = CausalLMConformanceSpec(parallel=("dp_shard2",))
