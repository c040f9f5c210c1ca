"""The package-level Python API: `spindle.train(config, **overrides)` and `spindle.load_generator(path,
**engine_options)`, as quiet as the CLI.

`config` is a YAML file or a mapping of the same sections; overrides are the CLI's dotted keys, given as
`**{"train.lr": 1e-4}` or with `__` for the dots (`train__lr=1e-4`); values are Python values (a mapping
or list is written as YAML flow, so `train__lora={"rank": 16}` is `train.lora={rank: 16}` on the CLI).
Both silence what the CLI silences (`spindle.quiet`: the libraries' progress bars and known-harmless
warnings) unless `verbose=True`, and the trainer's run log (summary, resume, checkpoint writes) is shown
on stderr as `spindle train` shows it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spindle.quiet import quiet_libraries


def override_strings(overrides: Mapping[str, Any]) -> list[str]:
    """`{"train.lr": 1e-4, "data__path": "x"}` -> the CLI's `key=value` overrides (JSON is YAML)."""
    return [
        f"{key.replace('__', '.')}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in overrides.items()
    ]


def train(config: str | Path | Mapping[str, Any], verbose: bool = False, **overrides: Any) -> Any:
    """Train as `spindle train CONFIG key=value ...` does, in this process -> `TrainResult` (output_dir,
    last_step, export_dir). A bad key or value raises `ConfigError` naming it before any model loads."""
    from spindle.api import load_job_config
    from spindle.api import train as run_job
    from spindle.commands.train import show_run_log

    if not verbose:
        quiet_libraries()
    show_run_log()
    source = dict(config) if isinstance(config, Mapping) else config
    return run_job(load_job_config(source, override_strings(overrides)))


def load_generator(root: str | Path, family: str | None = None, verbose: bool = False, **engine_options: Any) -> Any:
    """`spindle.api.load_generator` (a `DiffusionGenerator` for a pipeline folder or cached repo id), quiet
    unless `verbose`."""
    from spindle.api import load_generator as load

    if not verbose:
        quiet_libraries()
    return load(root, family, **engine_options)
