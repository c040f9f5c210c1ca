"""Training: the loop (trainer.py), its parts and tasks. The package is also `spindle.train(config,
**overrides)`, the Python API's entry point (`spindle.python_api.train`): see spindle/__init__.py for why
the subpackage itself is callable."""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, config: Any, /, verbose: bool = False, **overrides: Any) -> Any:
        from spindle.python_api import train

        return train(config, verbose=verbose, **overrides)


sys.modules[__name__].__class__ = _CallableModule
