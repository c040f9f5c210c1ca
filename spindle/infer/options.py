"""Family sampling options: each family declares them once, typed; the CLI and the server read them.

A family's `FamilyOptions` (on its `DiTFamily`, so it is known without loading the model) says:

- `extra`: its own knobs beyond the common `SamplingParams` fields, each an `Option` (name, type,
  default, bounds, help, an optional cross-field rule). They travel in `SamplingParams.extra`.
- `guidance`: what the common `guidance_scale` means for this family (CFG scale for Wan, the
  *embedded* guidance for Flux, ignored by non-distilled Qwen-Image), shown in help texts.
- `fps` / `frame_multiple`: a video family's native frame rate (mp4 writing, seconds -> frames) and
  the frame-count rule `num_frames = k * frame_multiple + 1`.

Where the declaration is read (no per-family code there):
- `spindle generate`: `add_option_arguments` adds one `--flag` per option declared by any family
  (`true_cfg_scale` -> `--true-cfg-scale`); `option_values(args)` gathers the given ones.
- the server: `request_fields(options)` -> extra pydantic fields of the HTTP request bodies.
- the engine: `DiffusionGenerator.validate` calls `FamilyOptions.validate` on what the user gave
  (before the family's defaults fill the rest): unknown names, wrong types, bounds and the rules
  are checked there, once, with a `RequestError` naming the family and the field.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:  # request.py imports torch; this module stays light for the CLI's parser
    from pydantic import BaseModel

    from spindle.infer.request import SamplingParams

M = TypeVar("M", bound="BaseModel")  # a pydantic request model
_TYPES = (bool, int, float, str)


def _request_error(message: str) -> Exception:
    from spindle.infer.request import RequestError  # imported here: request.py needs torch

    return RequestError(message)


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

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(f"option {self.name!r}: type must be one of {[t.__name__ for t in _TYPES]}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def bounds(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f"between {self.minimum:g} and {self.maximum:g}"
        if self.minimum is not None:
            return f">= {self.minimum:g}"
        if self.maximum is not None:
            return f"<= {self.maximum:g}"
        return ""

    def check(self, value: Any, family: str) -> Any:
        """The value as this option's type (an int is a valid float), or RequestError naming it."""
        ok = isinstance(value, self.type) and not (self.type is not bool and isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise _request_error(
                f"{self.name} must be {'a number' if self.type is float else 'a ' + self.type.__name__}"
                f"{' ' + self.bounds() if self.bounds() else ''} for {family}; got {value!r}"
            )
        if self.type is float and not math.isfinite(value):
            raise _request_error(f"{self.name} must be a finite number for {family}; got {value!r}")
        low, high = self.minimum, self.maximum
        if (low is not None and value < low) or (high is not None and value > high):
            raise _request_error(f"{self.name} must be {self.bounds()} for {family}; got {value!r}")
        return value


@dataclass(frozen=True)
class FamilyOptions:
    """A family's sampling options (see the module docstring)."""

    extra: tuple[Option, ...] = ()
    guidance: str = "classifier-free guidance scale (> 1 enables CFG)"
    fps: int | None = None
    frame_multiple: int | None = None

    def __post_init__(self) -> None:
        names = [o.name for o in self.extra]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"family options {repeated} are declared twice")

    def check_common_fields(self) -> None:
        """An option must not shadow a common `SamplingParams` field (run when an engine loads; kept
        out of the constructor so that declaring options imports no torch)."""
        from spindle.infer.request import SamplingParams

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
            raise _request_error(f"{unknown[0]} is not an option of {family} (its options: {known})")
        typed = {k: by_name[k].check(v, family) for k, v in params.extra.items()}
        params = dataclasses.replace(params, extra=typed)
        for name, value in typed.items():
            rule = by_name[name].rule
            message = rule(value, params) if rule is not None else None
            if message:
                raise _request_error(f"{name}: {message}")
        return params


def needs_negative_prompt(value: Any, params: SamplingParams) -> str | None:
    """Rule for a true-CFG scale: diffusers silently skips CFG without a negative prompt; say so."""
    if value > 1 and params.negative_prompt is None:
        return (
            f"true_cfg_scale={value:g} enables CFG only with a negative_prompt (diffusers would silently skip "
            'it); pass negative_prompt ("" for an empty one) or set true_cfg_scale to 1'
        )
    return None


# ---------------------------------------------------------------- readers: CLI and HTTP


def _sampling_families(families: Iterable[Any] | None = None) -> list[Any]:
    """The families (default: the registered ones) that declare sampling options: the diffusion
    families `spindle generate` and the server run; language models declare none."""
    if families is None:
        from spindle.registry import all_families

        families = all_families()
    return [f for f in families if isinstance(getattr(f, "options", None), FamilyOptions)]


def _families_options(families: Iterable[Any] | None = None) -> dict[str, list[tuple[str, Option]]]:
    """option name -> [(family name, Option)] over the families with sampling options (the
    declarations are light: reading them imports no model code)."""
    out: dict[str, list[tuple[str, Option]]] = {}
    for fam in _sampling_families(families):
        for opt in fam.options.extra:
            out.setdefault(opt.name, []).append((fam.name, opt))
    for name, decls in out.items():
        if len({o.type for _, o in decls}) > 1:
            raise TypeError(f"families {[f for f, _ in decls]} declare option {name!r} with different types")
    return out


def add_option_arguments(p: argparse.ArgumentParser, families: Iterable[Any] | None = None) -> None:
    """One flag per family option (default None: the family's default applies)."""
    g = p.add_argument_group("family options (the model's family must declare them)")
    for name, decls in sorted(_families_options(families).items()):
        opt = decls[0][1]
        who = ", ".join(f"{f} default {o.default!r}" for f, o in decls)
        kind = (lambda s: s.lower() in ("1", "true", "yes")) if opt.type is bool else opt.type
        g.add_argument(
            opt.flag, dest=f"option_{name}", metavar=name.upper(), type=kind, default=None, help=f"{opt.help} ({who})"
        )


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The family options given on the command line (flags added by `add_option_arguments`)."""
    prefix = "option_"
    return {k[len(prefix) :]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}


def guidance_help(families: Iterable[Any] | None = None) -> str:
    """What `guidance_scale` means, per family with sampling options (not the language models)."""
    return "; ".join(f"{f.name}: {f.options.guidance}" for f in _sampling_families(families))


def request_fields(options: FamilyOptions) -> dict[str, Any]:
    """pydantic field definitions (for `pydantic.create_model`) of a family's options: optional,
    typed; bounds are checked by `FamilyOptions.validate`, so the HTTP and Python paths share them."""
    from pydantic import Field

    return {
        o.name: (o.type | None, Field(default=None, description=f"{o.help} (default {o.default!r})"))
        for o in options.extra
    }


def request_model(base: type[M], options: FamilyOptions) -> type[M]:
    """`base` (a pydantic request model) extended with the family's options as optional fields."""
    from pydantic import create_model

    if not options.extra:
        return base
    return cast("type[M]", create_model(base.__name__, __base__=base, **request_fields(options)))


def given_options(body: Any, options: FamilyOptions) -> dict[str, Any]:
    """The family options a parsed request body carries (None: not given, the default applies)."""
    return {name: getattr(body, name) for name in options.names() if getattr(body, name, None) is not None}
