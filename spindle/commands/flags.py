"""Command-line flags generated from the fields of a typed section (`spindle.config.OptionSection`).

Every field gets a flag, named after it (`cache_threshold` -> `--cache-threshold`, or the field's
`json_schema_extra["flag"]`), with the field's description as help and its default:
- bool: `--x` / `--no-x`;
- a Literal: its values as the choices;
- `X | None`: a value of type X (absent: the field's default);
- a dict: `--flag KEY=VALUE`, repeatable (values are Python literals, else strings);
- a nested section: left to the caller (its fields get their own flags).

`section_from_args(args, Section)` builds the section from the parsed flags; a bad value raises
`ConfigError` naming the flag (`--max-steps must be >= 0 (0: no limit); got -1`).
"""

from __future__ import annotations

import argparse
import ast
import types
from collections.abc import Iterable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from spindle.config import OptionSection


def flag_name(name: str, info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    flag = extra.get("flag")
    return str(flag) if flag else "--" + name.replace("_", "-")


def flag_names(section: type[OptionSection]) -> dict[str, str]:
    """field name -> its flag."""
    return {name: flag_name(name, info) for name, info in section.model_fields.items()}


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(`X`, True) for `X | None`; (annotation, False) otherwise; constraints (`Annotated`) dropped."""
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(args) < len(get_args(annotation)):
            annotation, optional = args[0], True
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation, optional


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.default_factory()  # type: ignore[call-arg]  # a factory without arguments (ours all are)
    return None if info.default is PydanticUndefined else info.default


def parse_key_values(flag: str, items: Iterable[str]) -> dict[str, Any]:
    """`["max_skip_steps=2", "spatial_attention_timestep_skip_range=(100, 900)"]` -> dict (Python literals;
    anything else stays a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE (e.g. max_skip_steps=2); got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def add_section_arguments(group: Any, section: type[OptionSection]) -> None:
    """One flag per field of `section` on `group` (a parser or an argument group); nested sections are
    skipped. The flag's `dest` is the field name."""
    for name, info in section.model_fields.items():
        annotation, optional = unwrap_optional(info.annotation)
        if _is_section(annotation):
            continue
        flag, default = flag_name(name, info), _default(info)
        help_text = info.description or ""
        kw: dict[str, Any] = {"dest": name, "default": default}
        if annotation is bool:
            help_text += f" (default: {flag if default else '--no-' + flag[2:]})"
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_text, **kw)
            continue
        if get_origin(annotation) is Literal:
            kw["choices"] = get_args(annotation)
        elif get_origin(annotation) is dict or annotation is dict:
            kw.update(action="append", default=[], metavar="KEY=VALUE")
            help_text += " (repeatable)"
        elif annotation in (int, float, str):
            kw["type"] = annotation
        else:
            raise TypeError(f"{section.__name__}.{name}: no flag for type {annotation!r}")
        if default not in (None, {}):
            help_text += f" (default: {default})"
        elif optional and "default" not in help_text:
            help_text += " (default: none)"
        group.add_argument(flag, help=help_text, **kw)


def section_values(args: argparse.Namespace, section: type[OptionSection]) -> dict[str, Any]:
    """The values of `section`'s flags (those `add_section_arguments` added), by field name."""
    out = {}
    for name, info in section.model_fields.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        annotation, _ = unwrap_optional(info.annotation)
        if get_origin(annotation) is dict or annotation is dict:
            value = parse_key_values(flag_name(name, info), value)
        out[name] = value
    return out


def section_from_args(args: argparse.Namespace, section: type[OptionSection], **values: Any) -> Any:
    """`section` built from its flags (plus `values`, e.g. a nested section); errors name the flags."""
    flags = flag_names(section)
    return section.from_values({**section_values(args, section), **values}, lambda name: flags.get(name, name))


SAMPLING = "sampling_"  # the `dest` prefix of the sampling flags (apart from the engine's: `--lora` is a load option)


def add_sampling_arguments(
    p: argparse.ArgumentParser,
    families: Iterable[Any],
    *,
    skip: Iterable[str] = ("lora", "lora_scale"),
    required: Iterable[str] = ("prompt",),
    notes: dict[str, str] | None = None,
) -> None:
    """One flag per field of the families' sampling schemas (`spindle.contracts.sampling`: the common fields,
    then every family's options), with the field's description, bounds and defaults as help (`notes`: more help
    for a field, e.g. what guidance means per family). `skip`: fields without a flag; `required`: flags that
    must be given. The values are `sampling_values(args)`."""
    from spindle.contracts.options import FamilyOptions
    from spindle.contracts.sampling import CommonSampling, bounds_text, option_field

    notes = notes or {}
    skip, required = set(skip), set(required)
    group = p.add_argument_group("sampling parameters (checked by the model family's schema)")
    for name, info in CommonSampling.model_fields.items():
        if name not in skip:
            bounds = bounds_text(info, _scalar(info))
            text = (info.description or "") + (f" ({bounds})" if bounds else "")
            _add_sampling_flag(
                group, name, info, name in required, text + (f"; {notes[name]}" if name in notes else "")
            )
    options: dict[str, list[tuple[str, Any]]] = {}
    for fam in families:
        if isinstance(getattr(fam, "options", None), FamilyOptions):
            for opt in fam.options.extra:
                options.setdefault(opt.name, []).append((fam.name, opt))
    group = p.add_argument_group("family options (the model's family must declare them)")
    for name, decls in sorted(options.items()):
        if len({o.type for _, o in decls}) > 1:
            raise TypeError(f"families {[f for f, _ in decls]} declare option {name!r} with different types")
        opt = decls[0][1]
        who = ", ".join(f"{f} default {o.default!r}" for f, o in decls)
        _, info = option_field(opt)
        bounds = bounds_text(info, opt.type)
        text = f"{info.description} ({who}{'; ' + bounds if bounds else ''})"
        _add_sampling_flag(group, name, info, False, text, kind=opt.type)


def _scalar(info: FieldInfo) -> Any:
    """A sampling field's type on the command line: its scalar type (a prompt's list form is the Python API's)."""
    annotation, _ = unwrap_optional(info.annotation)
    scalars = [a for a in (get_args(annotation) or (annotation,)) if a in (int, float, str, bool)]
    return scalars[0] if scalars else str


def _add_sampling_flag(group: Any, name: str, info: FieldInfo, required: bool, text: str, kind: Any = None) -> None:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    kind, flag = kind or _scalar(info), flag_name(name, info)
    kw: dict[str, Any] = {"dest": SAMPLING + name, "default": None, "help": text, "required": required}
    kw["metavar"] = extra.get("metavar") or flag[2:].upper().replace("-", "_")
    if extra.get("repeat"):
        kw["action"] = "append"
    if kind is bool:
        kw["type"] = lambda s: s.lower() in ("1", "true", "yes")
    elif kind is not str:
        kw["type"] = kind
    group.add_argument(flag, **kw)


def sampling_values(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given (those `add_sampling_arguments` added), by field name."""
    return {k[len(SAMPLING) :]: v for k, v in vars(args).items() if k.startswith(SAMPLING) and v is not None}
