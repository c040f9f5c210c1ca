"""Wan2.2 A14B's two experts, shared by its text- and image-to-video families.

A two-expert folder is a stock `WanPipeline` / `WanImageToVideoPipeline` with a second transformer
(`transformer_2` in model_index.json) and `boundary_ratio`: diffusers denoises the steps whose timestep
is >= `boundary_ratio x num_train_timesteps` with `transformer` (the high-noise expert, CFG scale
`guidance_scale`) and the rest with `transformer_2` (the low-noise expert, `guidance_scale_2`, which
defaults to `guidance_scale`). Training fine-tunes one expert (`train.expert`), on its own timesteps.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from spindle.contracts.family import ConformanceSpec
from spindle.contracts.options import Option
from spindle.models.shared.declarations import amended

if TYPE_CHECKING:  # the family records import this module: no torch at `spindle --help`
    import torch

    from spindle.contracts.request import Req

# train.expert -> the checkpoint component it names
EXPERTS = {"high_noise": "transformer", "low_noise": "transformer_2"}
BOUNDARY = "boundary_ratio"  # the model_index.json key (WanPipeline's config)


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


def is_two_expert(model_index: dict[str, Any]) -> bool:
    """model_index.json names a second transformer and the boundary between the two."""
    second = model_index.get("transformer_2")
    return model_index.get(BOUNDARY) is not None and isinstance(second, list) and second[0] is not None


def check_two_expert(model_index: dict[str, Any], family: str) -> None:
    if not is_two_expert(model_index):
        raise ValueError(
            f"{family} serves two-expert Wan2.2 A14B folders (transformer_2 and boundary_ratio in model_index.json); "
            "this folder has one transformer: load it as its single-transformer family (remove model.family)"
        )


def refuse_two_expert(model_index: dict[str, Any], family: str, variant: str) -> None:
    """For the single-transformer families: a two-expert folder forced onto them (model.family)."""
    if model_index.get(BOUNDARY) is not None or (model_index.get("transformer_2") or [None])[0]:
        raise ValueError(
            f"this is a two-expert Wan2.2 A14B folder (transformer_2 / boundary_ratio), which {family} does not "
            f"serve; it is the {variant} family's: remove model.family (or set it to {variant})"
        )


GUIDANCE_SCALE_2 = Option(
    "guidance_scale_2",
    float,
    None,
    "CFG scale of the low-noise expert's steps (default: guidance_scale); CFG runs when guidance_scale > 1",
    minimum=0.0,
)


class TwoExpertInference:
    """Mixin for a Wan inference spec: the second expert loaded and switched to at the boundary."""

    family: str
    expert_components: tuple[str, ...] = ("transformer_2",)
    pipeline_config: tuple[str, ...] = (BOUNDARY,)

    def check_checkpoint(self, model_index: dict[str, Any]) -> None:
        check_two_expert(model_index, self.family)

    def step_denoiser(self, req: Req, t: torch.Tensor) -> tuple[str, float]:
        # WanPipeline: `t >= boundary_timestep` -> transformer at guidance_scale, else transformer_2
        if t >= req.extra["boundary_timestep"]:
            return "transformer", req.cfg_scale
        return "transformer_2", req.extra["cfg_scale_2"]


class TwoExpertStage:
    """Mixin for a Wan before-denoising stage: the boundary timestep and the low-noise expert's CFG scale
    on the request (`req.extra`), as `WanPipeline.__call__` computes them."""

    components: dict[str, Any]
    scheduler: Any

    def forward(self, req: Req) -> Req:
        req = super().forward(req)  # type: ignore[misc]  # the Wan stage this mixes into
        ratio = float(self.components[BOUNDARY])
        req.extra["boundary_timestep"] = ratio * self.scheduler.config.num_train_timesteps
        scale_2 = req.params.extra.get("guidance_scale_2")
        req.extra["cfg_scale_2"] = req.cfg_scale if scale_2 is None else float(scale_2)
        return req


class TwoExpertCondition:
    """Mixin for a Wan condition model: which expert a run trains and the sigmas it draws."""

    sigma_range: tuple[float, float]
    boundary_ratio: float | None = None

    @classmethod
    def trained_component(cls, model_index: dict[str, Any], expert: str | None) -> str:
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

    def read_checkpoint(self, root: Any) -> None:
        from spindle.infer.pipeline import read_model_index

        super().read_checkpoint(root)  # type: ignore[misc]  # the Wan condition model this mixes into
        self.boundary_ratio = float(read_model_index(root)[BOUNDARY])

    def select_expert(self, expert: str) -> None:
        assert self.boundary_ratio is not None, "read_checkpoint reads boundary_ratio"
        ratio = self.boundary_ratio
        # training's timestep is sigma x num_train_timesteps, so the boundary is at sigma = boundary_ratio
        self.sigma_range = (ratio, 1.0) if expert == "high_noise" else (0.0, ratio)
