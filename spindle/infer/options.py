"""Readers of the families' sampling options (`spindle.contracts.options`): CLI flags and HTTP fields.

The caller passes the families (the entry point resolves them through the registry):
- `spindle generate`: `add_option_arguments` adds one `--flag` per option declared by any family
  (`true_cfg_scale` -> `--true-cfg-scale`); `option_values(args)` gathers the given ones.
- the server: `request_fields(options)` -> extra pydantic fields of the HTTP request bodies.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from spindle.contracts.options import FamilyOptions, Option

if TYPE_CHECKING:
    from pydantic import BaseModel

M = TypeVar("M", bound="BaseModel")  # a pydantic request model


def _sampling_families(families: Iterable[Any]) -> list[Any]:
    """The families that declare sampling options: the diffusion families `spindle generate` and the
    server run; language models declare none."""
    return [f for f in families if isinstance(getattr(f, "options", None), FamilyOptions)]


def _families_options(families: Iterable[Any]) -> dict[str, list[tuple[str, Option]]]:
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


def add_option_arguments(p: argparse.ArgumentParser, families: Iterable[Any]) -> None:
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


def guidance_help(families: Iterable[Any]) -> str:
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
