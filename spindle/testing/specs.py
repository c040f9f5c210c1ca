"""A family's conformance spec, found by family name: its folder's `conformance.py` (the record's `package`, default
`spindle.models.<name>`) defines it as `<NAME>` (the family name upper-cased: `WAN22_I2V`, `FLUX2_KLEIN`), so two
records sharing a folder (flux2 and flux2_klein) each have theirs. The records carry no test data; production
never imports a conformance module (tests/project/test_structure.py).

A folder without `conformance.py`: a causal-LM family runs the suite with the defaults
(`CausalLMConformanceSpec()`), a DiT family has no spec (tests/conformance/test_conformance.py requires one)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from spindle.contracts.family import CausalLMFamily, DiTFamily
from spindle.models.shared.conformance import CausalLMConformanceSpec, ConformanceSpec


def _record(family: str | DiTFamily | CausalLMFamily) -> DiTFamily | CausalLMFamily:
    if isinstance(family, str):
        from spindle.registry import get_family

        return get_family(family)
    return family


def declared(family: str | DiTFamily | CausalLMFamily) -> Any:
    """The spec `family` (a name or a record) declares, or None when its folder has no conformance module."""
    record = _record(family)
    module = f"{record.package or 'spindle.models.' + record.name}.conformance"
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no such package: a record renamed without its folder
        found = False
    if not found:
        return None
    attr = record.name.upper()
    loaded = importlib.import_module(module)
    if not hasattr(loaded, attr):
        raise AssertionError(f"{module} defines no {attr}, the conformance spec of family {record.name!r}")
    return getattr(loaded, attr)


def dit_spec(family: str | DiTFamily) -> ConformanceSpec | None:
    """A DiT family's `ConformanceSpec`, or None where it declares none."""
    spec = declared(family)
    assert spec is None or isinstance(spec, ConformanceSpec), f"{family}: {type(spec).__name__}, not a ConformanceSpec"
    return spec


def lm_spec(family: str | CausalLMFamily) -> CausalLMConformanceSpec:
    """A causal-LM (VLM, omni) family's `CausalLMConformanceSpec`: its declared one, else the defaults."""
    spec = declared(family)
    if spec is None:
        return CausalLMConformanceSpec()
    assert isinstance(spec, CausalLMConformanceSpec), f"{family}: {type(spec).__name__}, not a CausalLMConformanceSpec"
    return spec
