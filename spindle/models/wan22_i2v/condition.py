"""Wan2.2 A14B image-to-video's condition model: Wan I2V's without image embeddings, training one expert
on its timesteps (`spindle.models.wan22.experts`)."""

from __future__ import annotations

from spindle.models.wan22.experts import TwoExpertCondition
from spindle.models.wan_i2v.condition import WanI2VConditionModel


class Wan22I2VConditionModel(TwoExpertCondition, WanI2VConditionModel):
    fixed_text_length = None  # the transformers read no image tokens from the context


CONDITION_MODEL = Wan22I2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
