"""Wan2.2 A14B T2V's conformance spec: how the conformance suite exercises it.

Test data, found by family name (spindle.testing.specs): only the test suites import it."""

from __future__ import annotations

import dataclasses
from typing import Any

from spindle.models.shared.conformance import ConformanceSpec, amended
from spindle.models.wan.conformance import WAN


def two_expert_conformance(spec: ConformanceSpec, expert: str, **fields: Any) -> ConformanceSpec:
    """The suite's spec of a two-expert family from its one-expert base's `spec`: the tiny checkpoint's boundary
    (0.9 x 1000) falls inside both schedules, so both experts denoise every case; guidance_scale_2 as stock (its
    own scale in the CFG case, guidance_scale's without); training runs fine-tune `expert` (train.expert)."""
    return dataclasses.replace(
        spec,
        parity_cases=amended(spec.parity_cases, {"guidance_scale_2": 3.0}, only="cfg"),
        cache_steps=5,  # t = 1000, 923 (high-noise expert), 818, 667, 429: three steps to skip
        train_overrides={"train__expert": expert},
        **fields,
    )


WAN22 = two_expert_conformance(WAN, "high_noise")
