"""One schema for sampling parameters: a strict pydantic model per family, built from its one declaration.

`sampling_schema(options, family)` -> `SamplingSchema`: `model` is `CommonSampling` (the fields every family
shares: prompt, sizes, steps, guidance, seed, images, LoRA choice) plus each option the family declares
(`FamilyOptions.extra`, an `Option`) as a field, its bounds as `Field` constraints and its rule as a model
validator; an unknown field is refused naming the family's options and the closest valid one. Every reader
goes through it:

- the engine: `DiffusionGenerator.validate` parses what the user gave (`SamplingSchema.parse`) before the
  family's defaults are merged, then runs the checks that need the loaded model (sizes, frame counts);
- `spindle generate`: one flag per field (`spindle.infer.options.add_sampling_arguments`), help with bounds and
  defaults;
- the server: the HTTP bodies' sampling fields (`spindle.infer.options.request_model`).

A refusal is a `RequestError` naming the field in the engine's words (`must be between 1 and 10 for fam; got
11.0`): `describe` turns pydantic's error records into them. Input images are read by
`spindle.contracts.images` (their one home) from the `image` validator.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from spindle.contracts.images import as_list, request_images
from spindle.contracts.options import FamilyOptions, Option
from spindle.contracts.request import RequestError, SamplingParams, short_repr

MAX_GUIDANCE = 100.0  # CFG scales in use are 1-20; far larger ones only blow the latents up


class CommonSampling(BaseModel):
    """The sampling fields every family shares (None: the family's default). Strict: no "2" for 2, no True
    for 1; frozen. A family's model (`sampling_schema`) adds its options."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, arbitrary_types_allowed=True)

    prompt: str | list[str] | None = Field(
        None, validate_default=True, description="text prompt (or a list of prompts: a batch)"
    )
    negative_prompt: str | list[str] | None = Field(
        None, description="negative prompt (classifier-free guidance): one, or one per prompt"
    )
    height: int | None = Field(None, description="height in pixels (the family's default if omitted)")
    width: int | None = Field(None, description="width in pixels (the family's default if omitted)")
    num_frames: int | None = Field(None, description="number of frames (video families)")
    num_inference_steps: int | None = Field(
        None, ge=1, description="denoising steps", json_schema_extra={"flag": "--steps"}
    )
    guidance_scale: float | None = Field(
        None,
        ge=0,
        le=MAX_GUIDANCE,
        allow_inf_nan=False,
        description="guidance scale",
        json_schema_extra={"flag": "--guidance"},
    )
    seed: int | None = Field(None, ge=0, lt=2**63, description="seed (random if omitted; reported back)")
    num_outputs_per_prompt: int = Field(1, ge=1, description="outputs per prompt")
    max_sequence_length: int | None = Field(None, description="text tokens per prompt (the family's default)")
    # the request's input images, as given (a PIL image, a uint8 array, a file path; one or a list); validated
    # they are RGB PIL images, `last_image` appended (a first-last-frame video family's last frame)
    image: Any = Field(
        None,
        description="conditioning image file(s) (image-to-video: the first frame; an edit's input images; repeat "
        "for families taking several)",
        json_schema_extra={"repeat": True, "metavar": "PATH"},
    )
    last_image: Any = Field(
        None,
        description="the last frame's image (first-last-frame video families, Wan FLF2V; with one image)",
        json_schema_extra={"metavar": "PATH"},
    )
    lora: str | None = Field(
        None, min_length=1, description="name of a LoRA adapter the engine has loaded (run-time adapters)"
    )
    lora_scale: float | None = Field(None, allow_inf_nan=False, description="the adapter's strength (default 1)")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str | list[str] | None) -> str | list[str]:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
        if not prompts:
            raise ValueError("prompt is required: a non-empty string (or a non-empty list of strings)")
        for p in prompts:
            if not p.strip():
                raise ValueError(f"prompt must be a non-empty string; got {short_repr(p)}")
            _check_text("prompt", p)
        assert prompt is not None
        return prompt

    @field_validator("negative_prompt")
    @classmethod
    def _negative_prompt(cls, negative: str | list[str] | None) -> str | list[str] | None:
        for n in [negative] if isinstance(negative, str) else negative or []:
            _check_text("negative_prompt", n)
        return negative

    @model_validator(mode="after")
    def _one_negative_per_prompt(self) -> CommonSampling:
        negative, prompt = self.negative_prompt, self.prompt
        if isinstance(negative, list) and len(negative) != (1 if isinstance(prompt, str) else len(prompt or [])):
            raise ValueError(
                f"negative_prompt has {len(negative)} entries but prompt has "
                f"{1 if isinstance(prompt, str) else len(prompt or [])}; give one per prompt (or a single string for all)"
            )
        return self


def _check_text(name: str, text: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (JSON "\\ud800") breaks the tokenizer and
    every JSON answer that echoes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} contains a lone surrogate code point; send valid Unicode text") from None


COMMON_FIELDS = tuple(CommonSampling.model_fields)


def common_field(name: str) -> Any:
    """A copy of the common field `name` (its type's constraints, description): what another model carrying the
    same value declares (the HTTP bodies: `spindle.serve.schemas`), so that it has the schema's bounds."""
    return copy.copy(CommonSampling.model_fields[name])


# a validator's own message names its field; these are the fields a model validator's message is about
_MODEL_RULE_FIELD = {"negative_prompt has": "negative_prompt"}

# the engine's words for a common field of the wrong type, or out of its bounds (`bound`: the Field constraint's)
_TYPE_WORDS = {
    "prompt": "prompt is required: a non-empty string (or a non-empty list of strings)",
    "negative_prompt": "negative_prompt must be a string or a list of strings",
    "num_inference_steps": "num_inference_steps must be an integer >= 1; got {got}",
    "num_outputs_per_prompt": "num_outputs_per_prompt must be an integer >= 1; got {got}",
    "guidance_scale": "guidance_scale must be a number (> 1 enables CFG); got {got}",
    "seed": "seed must be an integer >= 0; got {got}",
    "lora": "lora must be the name of a loaded adapter; got {got}",
    "lora_scale": "lora_scale must be a finite number (1: as trained); got {got}",
}
_BOUND_WORDS = {
    ("guidance_scale", "less_than_equal"): "guidance_scale must be a finite number <= {bound} (past ~20 outputs "
    "saturate); got {got}",
    ("guidance_scale", "finite_number"): "guidance_scale must be a finite number <= {bound} (past ~20 outputs "
    "saturate); got {got}",
    ("guidance_scale", "greater_than_equal"): "guidance_scale must be >= 0 (> 1 enables CFG, <= 1 disables it); "
    "got {got}",
    ("seed", "less_than"): "seed must be < 2**63; got {got}",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
BOUND_ERRORS = frozenset(_BOUNDS)  # pydantic's error types of a value out of a field's bounds


def bounds_text(info: FieldInfo, kind: type) -> str:
    """A field's bounds as the user types them: "between 0 and 100", ">= 1", "" (none); an int field's in full."""

    def number(value: Any) -> str:
        return str(int(value)) if kind is int else f"{value:g}"

    low = high = None
    for m in info.metadata:
        low = getattr(m, "ge", low)
        high = getattr(m, "le", high)
    if low is not None and high is not None:
        return f"between {number(low)} and {number(high)}"
    if low is not None:
        return f">= {number(low)}"
    if high is not None:
        return f"<= {number(high)}"
    return ""


@dataclass(frozen=True)
class SamplingSchema:
    """A family's sampling schema: its pydantic `model` and the words of its errors (see the module docstring)."""

    family: str
    options: FamilyOptions
    model: type[CommonSampling]

    def parse(self, values: dict[str, Any]) -> CommonSampling:
        """`values` (what the user gave; None: not given) validated -> the frozen model, images read. Raises
        `RequestError` naming the first field at fault."""
        try:
            return self.model(**values)
        except ValidationError as e:
            error: dict[str, Any] = dict(e.errors(include_url=False)[0])
            cause = error.get("ctx", {}).get("error")
            if isinstance(cause, RequestError):  # an image the images module refused, with its own field and code
                raise cause from None
            field = str(error["loc"][0]) if error["loc"] else ""
            message = self.describe(error)
            if not field:
                field = next((f for start, f in _MODEL_RULE_FIELD.items() if message.startswith(start)), "")
                field = field or message.split(":", 1)[0].split(" ", 1)[0]
            raise RequestError(message, field=field) from None

    def validate(self, params: SamplingParams) -> SamplingParams:
        """`params` as the user gave them (before the family's defaults) validated -> a copy with the values typed
        and the images read (RGB PIL); the family options in `extra`."""
        common = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "extra"}
        parsed = self.parse({**params.extra, **common})
        return self.params(parsed)

    def params(self, parsed: CommonSampling) -> SamplingParams:
        """The validated model -> the engine's `SamplingParams` (the options the user gave in `extra`)."""
        names = self.options.names()
        values = {k: getattr(parsed, k) for k in COMMON_FIELDS if k != "last_image"}
        extra = {
            k: getattr(parsed, k) for k in names if k in parsed.model_fields_set and getattr(parsed, k) is not None
        }
        return SamplingParams(**values, extra=extra)

    def describe(self, error: dict[str, Any]) -> str:
        """One pydantic error record -> the engine's words for it."""
        loc, kind = tuple(error["loc"]), error["type"]
        name = str(loc[0]) if loc else ""
        got = error.get("input")
        if kind == "extra_forbidden":
            known = self.options.names()
            close = difflib.get_close_matches(name, [*known, *COMMON_FIELDS], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            return f"{name} is not an option of {self.family} (its options: {', '.join(known) or 'none'}){hint}"
        if kind == "value_error":  # a validator's message (a rule's is prefixed with its option's name)
            return str(error.get("ctx", {}).get("error", error["msg"]))
        info = self.model.model_fields.get(name)
        option = next((o for o in self.options.extra if o.name == name), None)
        if option is not None and info is not None:
            return _option_words(option, info, kind, got, self.family)
        if name == "prompt" and isinstance(got, list) and got:  # an entry of a list of prompts
            entry = next((p for p in got if not isinstance(p, str)), got[0])
            return f"prompt must be a non-empty string; got {short_repr(entry)}"
        bound = _bound(info, kind)
        words = _BOUND_WORDS.get((name, kind))
        if words is not None:
            return words.format(bound=f"{bound:g}" if isinstance(bound, float) else bound, got=got)
        if kind in _BOUNDS:
            return f"{name} must be {_BOUNDS[kind]} {bound}; got {got}"
        words = _TYPE_WORDS.get(name, f"{name} must be an integer; got {{got}}")
        return words.format(got=type(got).__name__ if name == "lora" else short_repr(got))


def _bound(info: FieldInfo | None, kind: str) -> Any:
    key = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le", "less_than": "lt"}.get(kind)
    key = key or "le"  # finite_number: the upper bound names the range
    for m in info.metadata if info is not None else ():
        if getattr(m, key, None) is not None:
            return getattr(m, key)
    return None


def _option_words(option: Option, info: FieldInfo, kind: str, got: Any, family: str) -> str:
    bounds = bounds_text(info, option.type)
    if kind == "finite_number":
        return f"{option.name} must be a finite number for {family}; got {got!r}"
    if kind in _BOUNDS:
        return f"{option.name} must be {bounds} for {family}; got {got!r}"
    what = "a number" if option.type is float else f"a {option.type.__name__}"
    return f"{option.name} must be {what}{' ' + bounds if bounds else ''} for {family}; got {got!r}"


def option_bounds(option: Option) -> str:
    """An option's bounds as the user types them ("between 0 and 100"; "" for none), as its errors and help say."""
    return bounds_text(option_field(option)[1], option.type)


def option_field(option: Option) -> tuple[Any, FieldInfo]:
    """An option's field of the family's model: optional, its bounds as constraints, its default and help."""
    kw: dict[str, Any] = {}
    if option.minimum is not None:
        kw["ge"] = option.minimum
    if option.maximum is not None:
        kw["le"] = option.maximum
    if option.type is float:
        kw["allow_inf_nan"] = False
    info = Field(None, description=option.help, json_schema_extra={"default_value": option.default}, **kw)
    return option.type | None, info


@functools.cache
def sampling_schema(options: FamilyOptions, family: str) -> SamplingSchema:
    """The family's schema (cached: one model per declaration). Raises `ValueError` for an option that repeats a
    common field."""
    clash = sorted(set(options.names()) & set(COMMON_FIELDS))
    if clash:
        raise ValueError(f"family options {clash} repeat a common SamplingParams field")

    def images(parsed: CommonSampling) -> CommonSampling:
        # the request's images: the last frame appended, counted against what the family takes, read into RGB
        loaded = request_images(parsed.image, parsed.last_image, options.images, family)
        object.__setattr__(parsed, "image", loaded)  # (the model is frozen: set once, here)
        object.__setattr__(parsed, "last_image", None)
        return parsed

    def rules(parsed: CommonSampling) -> CommonSampling:
        for option in options.extra:
            value = getattr(parsed, option.name)
            # the default is what a request without the option runs with, so it is never refused
            if option.rule is None or value is None or value == option.default:
                continue
            message = option.rule(value, parsed)
            if message:
                raise ValueError(f"{option.name}: {message}")
        return parsed

    validators: dict[str, Any] = {
        "_options": model_validator(mode="after")(rules),
        "_images": model_validator(mode="after")(images),
    }
    fields = {o.name: option_field(o) for o in options.extra}
    name = "".join(part.title() for part in family.split("_")) + "Sampling"
    model = create_model(name, __base__=CommonSampling, __validators__=validators, **fields)  # type: ignore[call-overload]
    return SamplingSchema(family, options, model)


__all__ = [
    "COMMON_FIELDS",
    "CommonSampling",
    "SamplingSchema",
    "as_list",
    "bounds_text",
    "common_field",
    "option_bounds",
    "sampling_schema",
]
