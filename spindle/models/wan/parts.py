"""The part a Wan variant adds to Wan's code, by composition: Wan's inference spec, its before-denoising stage
and its condition model each hold an `ExpertsPart` (None: one transformer) and call it at the points below.
The variant's folder supplies the object (Wan2.2 A14B: `spindle.models.wan22.experts.TWO_EXPERTS`); Wan's
code never imports a variant.

`BOUNDARY` and `SECOND_TRANSFORMER` are stock diffusers' names (`WanPipeline(transformer_2=...,
boundary_ratio=...)`): Wan without a part refuses a folder that sets them, naming the family that serves it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the family records import the variants' parts: no torch at `spindle --help`
    import torch

    from spindle.contracts.request import Req

BOUNDARY = "boundary_ratio"  # model_index.json: the timestep fraction where the second transformer takes over
SECOND_TRANSFORMER = "transformer_2"  # model_index.json: the second transformer's component


class ExpertsPart(Protocol):
    """Further transformers that denoise some of the steps, each trained on its own timesteps."""

    # the further transformers (components), loaded, sped up, offloaded and parallelized as the main one
    components: tuple[str, ...]
    # model_index.json values `prepare_request` reads (handed to the stage in `components` under their names)
    pipeline_config: tuple[str, ...]

    def check_checkpoint(self, model_index: dict[str, Any], family: str) -> None:
        """Raise when the folder lacks what the part needs (the spec's `check_checkpoint`)."""
        ...

    def prepare_request(self, req: Req, components: dict[str, Any]) -> None:
        """After Wan's stage set the request's CFG scale and scheduler: what `step_denoiser` reads (`req.extra`)."""
        ...

    def step_denoiser(self, req: Req, t: torch.Tensor) -> tuple[str, float]:
        """(the component that denoises the step at timestep `t`, its CFG scale)."""
        ...

    def trained_component(self, model_index: dict[str, Any], expert: str | None) -> str:
        """The component a run trains for `train.expert` (raise for a missing or unknown choice)."""
        ...

    def sigma_range(self, model_index: dict[str, Any], expert: str) -> tuple[float, float]:
        """The sigmas `expert` denoises, which training draws within."""
        ...
