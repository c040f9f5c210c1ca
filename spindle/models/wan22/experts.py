"""Wan2.2 A14B's two experts, the part Wan2.2's text- and image-to-video families add to Wan's code.

A two-expert folder is a stock `WanPipeline` / `WanImageToVideoPipeline` with a second transformer
(`transformer_2` in model_index.json) and `boundary_ratio`: diffusers denoises the steps whose timestep
is >= `boundary_ratio x num_train_timesteps` with `transformer` (the high-noise expert, CFG scale
`guidance_scale`) and the rest with `transformer_2` (the low-noise expert, `guidance_scale_2`, which
defaults to `guidance_scale`). Training fine-tunes one expert (`train.expert`), on its own timesteps.

`TWO_EXPERTS` is the `spindle.models.wan.parts.ExpertsPart` the Wan2.2 A14B specs and condition models hold;
Wan's spec, stage and condition model call it (Wan imports nothing of this folder).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spindle.contracts.options import Option
from spindle.model_index import component_class
from spindle.models.wan.parts import BOUNDARY, SECOND_TRANSFORMER

if TYPE_CHECKING:  # the family records import this module: no torch at `spindle --help`
    import torch

    from spindle.contracts.request import Req

# train.expert -> the checkpoint component it names
EXPERTS = {"high_noise": "transformer", "low_noise": SECOND_TRANSFORMER}


def is_two_expert(model_index: dict[str, Any]) -> bool:
    """model_index.json names a second transformer and the boundary between the two."""
    return model_index.get(BOUNDARY) is not None and component_class(model_index, SECOND_TRANSFORMER) is not None


def check_two_expert(model_index: dict[str, Any], family: str) -> None:
    if not is_two_expert(model_index):
        raise ValueError(
            f"{family} serves two-expert Wan2.2 A14B folders (transformer_2 and boundary_ratio in model_index.json); "
            "this folder has one transformer: load it as its single-transformer family (remove model.family)"
        )


GUIDANCE_SCALE_2 = Option(
    "guidance_scale_2",
    float,
    None,
    "CFG scale of the low-noise expert's steps (default: guidance_scale); CFG runs when guidance_scale > 1",
    minimum=0.0,
)


class TwoExperts:
    """The two-expert part of Wan's spec, stage and condition model (`ExpertsPart`): the second expert loaded and
    switched to at the boundary, as `WanPipeline.__call__` does; training's sigmas on the trained expert's side."""

    components: tuple[str, ...] = (SECOND_TRANSFORMER,)
    pipeline_config: tuple[str, ...] = (BOUNDARY,)

    def check_checkpoint(self, model_index: dict[str, Any], family: str) -> None:
        check_two_expert(model_index, family)

    def prepare_request(self, req: Req, components: dict[str, Any]) -> None:
        # WanPipeline.__call__: boundary_timestep = boundary_ratio x num_train_timesteps; guidance_scale_2
        # defaults to guidance_scale
        ratio = float(components[BOUNDARY])
        req.extra["boundary_timestep"] = ratio * components["scheduler"].config.num_train_timesteps
        scale_2 = req.params.extra.get("guidance_scale_2")
        req.extra["cfg_scale_2"] = req.cfg_scale if scale_2 is None else float(scale_2)

    def step_denoiser(self, req: Req, t: torch.Tensor) -> tuple[str, float]:
        # WanPipeline: `t >= boundary_timestep` -> transformer at guidance_scale, else transformer_2
        if t >= req.extra["boundary_timestep"]:
            return "transformer", req.cfg_scale
        return SECOND_TRANSFORMER, req.extra["cfg_scale_2"]

    def trained_component(self, model_index: dict[str, Any], expert: str | None) -> str:
        if not is_two_expert(model_index):
            raise ValueError(
                "this folder has one transformer, not Wan2.2 A14B's two experts; remove model.family / train.expert"
            )
        if expert is None:
            raise ValueError(
                "train.expert is required for a two-expert Wan2.2 A14B checkpoint: high_noise (transformer, timesteps "
                f">= boundary_ratio={model_index[BOUNDARY]} x 1000) or low_noise (transformer_2, below it)"
            )
        return EXPERTS[expert]

    def sigma_range(self, model_index: dict[str, Any], expert: str) -> tuple[float, float]:
        # training's timestep is sigma x num_train_timesteps, so the boundary is at sigma = boundary_ratio
        ratio = float(model_index[BOUNDARY])
        return (ratio, 1.0) if expert == "high_noise" else (0.0, ratio)


TWO_EXPERTS = TwoExperts()
