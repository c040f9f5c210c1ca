"""A reward function named `path/to/file.py:function` or `module:function`, imported before any training:
a missing file, module or function is a `ConfigError` naming the spec and the fix."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from spindle.config import ConfigError


def load_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names (a file path is relative to the working directory)."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ConfigError(
            f"reward {spec!r}: give path/to/file.py:function or module:function (the function after the last ':')"
        )
    module = _import_file(spec, target) if target.endswith(".py") or "/" in target else _import_module(spec, target)
    if not hasattr(module, attr):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = (
            f"; did you mean {close[0]!r}?"
            if close
            else f"; it defines: {', '.join(sorted(names)) or 'nothing callable'}"
        )
        raise ConfigError(f"reward {spec!r}: {target} defines no function {attr!r}{hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"reward {spec!r}: {attr!r} in {target} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]  # a user's callable: its signature is the reward convention's


def _import_file(spec: str, target: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"reward {spec!r}: file {target} not found (looked at {path.resolve()}; relative paths are from the "
            "working directory)"
        )
    # a name of its own per file, so two reward files both called rewards.py do not replace each other
    digest = hashlib.blake2b(str(path.resolve()).encode(), digest_size=6).hexdigest()
    name = f"spindle_reward_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"reward {spec!r}: {target} cannot be imported as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"reward {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e
    return module


def _import_module(spec: str, target: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name is not None and target.startswith(e.name):
            raise ConfigError(
                f"reward {spec!r}: no module {e.name!r} on the Python path; give a file (path/to/file.py:function) "
                "or install the module"
            ) from e
        raise ConfigError(f"reward {spec!r}: importing {target} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"reward {spec!r}: importing {target} failed: {type(e).__name__}: {e}") from e


def accepts(fn: Callable[..., Any], names: set[str]) -> set[str]:
    """The keyword arguments among `names` that `fn` takes: all with **kwargs, else those it names (so a
    function written for one dataset does not fail on another's extra columns)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return names
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return names
    return names & {p.name for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}


def check_takes(fn: Callable[..., Any], spec: str, required: str, convention: str) -> None:
    """Refuse, before training, a function that cannot take the samples by their keyword (`required`)."""
    if required not in accepts(fn, {required}):
        raise ConfigError(
            f"reward {spec!r}: the function takes {inspect.signature(fn)}, but rewards are called as {convention} "
            f"(by keyword): it needs a parameter named {required!r} (or **kwargs)"
        )
