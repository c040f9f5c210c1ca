"""Wan2.2 A14B image-to-video's condition model: Wan I2V's without image embeddings, with the two-expert part
(`spindle.models.wan22.experts`): one expert trained, on its timesteps."""

from __future__ import annotations

from spindle.models.wan22.experts import TWO_EXPERTS
from spindle.models.wan_i2v.condition import WanI2VConditionModel


class Wan22I2VConditionModel(WanI2VConditionModel):
    experts = TWO_EXPERTS
    fixed_text_length = None  # the transformers read no image tokens from the context


CONDITION_MODEL = Wan22I2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
