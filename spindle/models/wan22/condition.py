"""Wan2.2 A14B text-to-video's condition model: Wan's, with the two-expert part (`experts.py`): one expert
trained, on its timesteps."""

from __future__ import annotations

from spindle.models.wan.condition import WanConditionModel
from spindle.models.wan22.experts import TWO_EXPERTS


class Wan22ConditionModel(WanConditionModel):
    experts = TWO_EXPERTS


CONDITION_MODEL = Wan22ConditionModel  # the family's condition model (DiTFamily finds it by this name)
