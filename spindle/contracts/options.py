"""Family sampling options: each family declares them once, typed; the CLI and the server read them.

A family's `FamilyOptions` (on its family record, so it is known without loading the model) says:

- `extra`: its own knobs beyond the common `SamplingParams` fields, each an `Option` (name, type,
  default, bounds, help, an optional cross-field rule). They travel in `SamplingParams.extra`.
- `guidance`: what the common `guidance_scale` means for this family (CFG scale for Wan, the
  *embedded* guidance for Flux, ignored by non-distilled Qwen-Image), shown in help texts.
- `fps` / `frame_multiple`: a video family's native frame rate (mp4 writing, seconds -> frames) and
  the frame-count rule `num_frames = k * frame_multiple + 1`.

The readers (CLI flags, HTTP fields) are in `spindle.infer.options`; the engine calls
`FamilyOptions.validate` once per request (`DiffusionGenerator.validate`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spindle.contracts.request import SamplingParams

_TYPES = (bool, int, float, str)


def _request_error(message: str, field: str) -> Exception:
    from spindle.contracts.request import RequestError  # imported here: request.py imports this module's users

    return RequestError(message, field=field)


@dataclass(frozen=True)
class Option:
    """One family-specific sampling option (a key of `SamplingParams.extra`)."""

    name: str
    type: type  # bool, int, float or str
    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    # A rule across fields, checked when the user gives the option: (value, the user's params) ->
    # an error message, or None when fine.
    rule: Callable[[Any, SamplingParams], str | None] | None = None
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

    def bounds(self) -> str:
        low, high = (None if b is None else self._number(b) for b in (self.minimum, self.maximum))
        if low is not None and high is not None:
            return f"between {low} and {high}"
        if low is not None:
            return f">= {low}"
        if high is not None:
            return f"<= {high}"
        return ""

    def _number(self, value: float) -> str:
        """A bound as the user types it: an int option's in full (4194304, not 4.19e+06)."""
        return str(int(value)) if self.type is int else f"{value:g}"

    def check(self, value: Any, family: str) -> Any:
        """The value as this option's type (an int is a valid float), or RequestError naming it."""
        ok = isinstance(value, self.type) and not (self.type is not bool and isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise _request_error(
                f"{self.name} must be {'a number' if self.type is float else 'a ' + self.type.__name__}"
                f"{' ' + self.bounds() if self.bounds() else ''} for {family}; got {value!r}",
                self.name,
            )
        if self.type is float and not math.isfinite(value):
            raise _request_error(f"{self.name} must be a finite number for {family}; got {value!r}", self.name)
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise _request_error(f"{self.name} must be {self.bounds()} for {family}; got {value!r}", self.name)
        return value


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

    def check_common_fields(self) -> None:
        """An option must not shadow a common `SamplingParams` field (run when an engine loads; kept
        out of the constructor so that declaring options imports no torch)."""
        from spindle.contracts.request import SamplingParams

        common = {f.name for f in dataclasses.fields(SamplingParams)}
        clash = sorted(set(self.names()) & common)
        if clash:
            raise ValueError(f"family options {clash} repeat a common SamplingParams field")

    def names(self) -> list[str]:
        return [o.name for o in self.extra]

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.extra}

    def validate(self, params: SamplingParams, family: str) -> SamplingParams:
        """Check the family options the user gave (`params.extra`, before defaults are merged):
        unknown names, types, bounds, then each option's rule. -> params with the values typed."""
        by_name = {o.name: o for o in self.extra}
        unknown = sorted(set(params.extra) - set(by_name))
        if unknown:
            known = ", ".join(self.names()) or "none"
            raise _request_error(f"{unknown[0]} is not an option of {family} (its options: {known})", unknown[0])
        # an option whose default is None ("unset") may be given as None: validated params carry the defaults,
        # and a generator validates them again when it runs them (the server validates, then runs)
        typed = {
            k: v if v is None and by_name[k].default is None else by_name[k].check(v, family)
            for k, v in params.extra.items()
        }
        params = dataclasses.replace(params, extra=typed, image=self.check_images(params.image, family))
        for name, value in typed.items():
            option = by_name[name]
            # the default is what a request without the option runs with, so it is never refused; this also
            # keeps validation idempotent (validated params carry the defaults, and a server validates twice)
            rule = option.rule if value != option.default else None
            message = rule(value, params) if rule is not None else None
            if message:
                raise _request_error(f"{name}: {message}", name)
        return params

    def check_images(self, images: Any, family: str) -> list[Any] | None:
        """The request's conditioning images, counted against `images` and read into RGB PIL images
        (`load_image`); a RequestError naming `image` otherwise. A single image may be given bare."""
        from spindle.contracts.request import load_image

        low, high = self.images
        if images is None or (isinstance(images, list) and not images):
            if low:
                raise _request_error(f"image is required for {family}: give {low} conditioning image(s)", "image")
            return None
        if not high:
            raise _request_error(f"image is not taken by {family} (it generates from text alone); drop it", "image")
        items = images if isinstance(images, (list, tuple)) else [images]
        if not low <= len(items) <= high:
            want = str(low) if low == high else f"{low} to {high}"
            raise _request_error(f"image: {family} takes {want} conditioning image(s); got {len(items)}", "image")
        return [load_image(item) for item in items]


def needs_negative_prompt(value: Any, params: SamplingParams) -> str | None:
    """Rule for a true-CFG scale: diffusers silently skips CFG without a negative prompt; say so."""
    if value > 1 and params.negative_prompt is None:
        return (
            f"true_cfg_scale={value:g} enables CFG only with a negative_prompt (diffusers would silently skip "
            'it); pass negative_prompt ("" for an empty one) or set true_cfg_scale to 1'
        )
    return None
