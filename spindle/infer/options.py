"""What `guidance_scale` means per family (`spindle generate`'s help) and the HTTP request bodies' family fields,
both read from the families' sampling schemas (`spindle.contracts.sampling`; the CLI flags are
`spindle.commands.flags.add_sampling_arguments`).

- the server: `request_model(base, schema)` -> `base` (a pydantic body) with the family's options as fields,
  typed and bounded as the schema's; `given_options(body, options)` reads them back.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from spindle.contracts.options import FamilyOptions

if TYPE_CHECKING:
    from pydantic import BaseModel

    from spindle.contracts.sampling import SamplingSchema

M = TypeVar("M", bound="BaseModel")  # a pydantic request model


def _sampling_families(families: Iterable[Any]) -> list[Any]:
    """The families that declare sampling options: the diffusion families `spindle generate` and the
    server run; language models declare none."""
    return [f for f in families if isinstance(getattr(f, "options", None), FamilyOptions)]


def guidance_help(families: Iterable[Any]) -> str:
    """What `guidance_scale` means, per family with sampling options (not the language models)."""
    return "; ".join(f"{f.name}: {f.options.guidance}" for f in _sampling_families(families))


def request_fields(schema: SamplingSchema) -> dict[str, Any]:
    """pydantic field definitions (for `pydantic.create_model`) of a family's options: the schema's own fields
    (optional, typed, bounded), each described with its default."""
    fields = {}
    for option in schema.options.extra:
        info = copy.copy(schema.model.model_fields[option.name])
        info.description = f"{option.help} (default {option.default!r})"
        fields[option.name] = (info.annotation, info)
    return fields


def request_model(base: type[M], schema: SamplingSchema) -> type[M]:
    """`base` (a pydantic request model) extended with the family's options as fields (`request_fields`)."""
    from pydantic import create_model

    if not schema.options.extra:
        return base
    return cast("type[M]", create_model(base.__name__, __base__=base, **request_fields(schema)))


def given_options(body: Any, options: FamilyOptions) -> dict[str, Any]:
    """The family options a parsed request body carries (None: not given, the default applies)."""
    return {name: getattr(body, name) for name in options.names() if getattr(body, name, None) is not None}
