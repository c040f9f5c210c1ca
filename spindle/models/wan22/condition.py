"""Wan2.2 A14B text-to-video's condition model: Wan's, training one expert on its timesteps (`experts.py`)."""

from __future__ import annotations

from spindle.models.wan.condition import WanConditionModel
from spindle.models.wan22.experts import TwoExpertCondition


class Wan22ConditionModel(TwoExpertCondition, WanConditionModel):
    pass


CONDITION_MODEL = Wan22ConditionModel  # the family's condition model (DiTFamily finds it by this name)
