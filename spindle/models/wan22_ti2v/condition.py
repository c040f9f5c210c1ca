"""Wan2.2 TI2V-5B's condition model: Wan's (the Wan2.2 VAE's latents, normalized by its 48 channel stats),
training text-to-video with one timestep per sample (the transformer broadcasts it over the tokens, as the
pipeline's per-token timestep is at every token in text-to-video)."""

from __future__ import annotations

from spindle.models.wan.condition import WanConditionModel


class Wan22TI2VConditionModel(WanConditionModel):
    pass
