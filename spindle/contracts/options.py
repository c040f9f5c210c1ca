"""Family sampling options: each family declares them once, typed; its sampling schema is built from them.

A family's `FamilyOptions` (on its family record, so it is known without loading the model) says:

- `extra`: its own knobs beyond the common `SamplingParams` fields, each an `Option` (name, type,
  default, bounds, help, an optional cross-field rule). They travel in `SamplingParams.extra`.
- `guidance`: what the common `guidance_scale` means for this family (CFG scale for Wan, the
  *embedded* guidance for Flux, ignored by non-distilled Qwen-Image), shown in help texts.
- `fps` / `frame_multiple`: a video family's native frame rate (mp4 writing, seconds -> frames) and
  the frame-count rule `num_frames = k * frame_multiple + 1`.

`spindle.contracts.sampling.sampling_schema(options, family)` is the family's strict pydantic model of its sampling parameters (the common
fields plus these, bounds as constraints, rules as validators); the CLI flags and
the HTTP fields are generated from it (`spindle.infer.options`), and the engine validates a request with it
once (`DiffusionGenerator.validate`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class Option:
    """One family-specific sampling option (a key of `SamplingParams.extra`)."""

    name: str
    type: type  # bool, int, float or str
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    # A rule across fields, checked when the user gives the option (not at its default): (value, the
    # validated request: its fields by name) -> an error message, or None when fine.
    rule: Callable[[Any, Any], str | None] | None = None
    # a pixel area of an image the request makes (an edit model's input resized to it): a server's
    # per-image pixel bound (`RequestLimits.max_pixels`, --max-pixels) applies to it as to the output
    pixels: bool = False
    # the output's pixel area, as the pipeline sizes it (FLUX.1 Kontext's `max_area`): where a request gives the
    # output size itself (the HTTP API's `size`, OpenAI's output size; the serve warm-up), this is set to
    # width x height unless the request gives it
    output_area: bool = False
    # a bool option resizing the input image(s) to the model's preferred resolution whatever the output's size
    # (FLUX.1 Kontext's `auto_resize`: ~1 megapixel): a request that gives the output size (the HTTP `size`)
    # turns it off unless it gives it, so the input is used at its own size, not enlarged past the output
    resizes_input: bool = False

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(f"option {self.name!r}: type must be one of {[t.__name__ for t in _TYPES]}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class FamilyOptions:
    """A family's sampling options (see the module docstring)."""

    extra: tuple[Option, ...] = ()
    guidance: str = "classifier-free guidance scale (> 1 enables CFG)"
    fps: int | None = None
    frame_multiple: int | None = None
    # how many conditioning images a request takes (`SamplingParams.image`): (minimum, maximum);
    # (0, 0) for text-to-X families, (1, 1) for image-to-video
    images: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        names = [o.name for o in self.extra]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"family options {repeated} are declared twice")

    def names(self) -> list[str]:
        return [o.name for o in self.extra]

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.extra}


def needs_negative_prompt(value: Any, params: Any) -> str | None:
    """Rule for a true-CFG scale: diffusers silently skips CFG without a negative prompt; say so."""
    if value > 1 and params.negative_prompt is None:
        return (
            f"true_cfg_scale={value:g} enables CFG only with a negative_prompt (diffusers would silently skip "
            'it); pass negative_prompt ("" for an empty one) or set true_cfg_scale to 1'
        )
    return None
