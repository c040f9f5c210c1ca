"""Regenerate the patched transformers modeling files from their patch configs, or check them for drift.

Configs are `spindle/models/*/patches.py` unless given (as paths or module names). Each writes
`generated/patched_modeling_<model>.py` and `.diff` next to it. `--check` regenerates in memory and
exits 1 naming every checked-in file that differs (a hand edit, a config changed without
regenerating, or a transformers upgrade); `--check --fix` rewrites them. See docs/patchgen.md.
"""

from __future__ import annotations

import argparse
import sys

LOADS_MODELS = False  # no diffusers import just to silence it (spindle.quiet)
HELP = "regenerate patched transformers modeling files (generated/), or --check them for drift"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*", metavar="CONFIG", help="patch config files or modules (default: all)")
    p.add_argument("--check", action="store_true", help="fail (exit 1) if a checked-in generated file is stale")
    p.add_argument("--fix", action="store_true", help="with --check: rewrite the stale files")


def run(args: argparse.Namespace) -> int:
    from spindle.patchgen.check import discover_configs, find_drift, generate_file, resolve_config_path, write
    from spindle.patchgen.spec import display_path

    if args.fix and not args.check:
        raise ValueError("--fix only goes with --check (plain `spindle patchgen` already rewrites everything)")
    paths = [resolve_config_path(c) for c in args.configs] if args.configs else discover_configs()
    if not paths:
        raise FileNotFoundError("no patch configs found (spindle/models/*/patches.py)")
    stale = 0
    for path in paths:
        generated = generate_file(path)
        if not args.check:
            write(generated)
            print(f"wrote {display_path(generated.py_path)} and .diff")
            continue
        drift = find_drift(generated)
        for d in drift:
            print(f"DRIFT {display_path(d.path)}: differs from what {display_path(path)} generates:\n{d.detail}")
        if drift and args.fix:
            write(generated)
            print(f"fixed {display_path(generated.py_path)} and .diff (review the .diff before committing)")
        elif drift:
            stale += len(drift)
    if stale:
        print(
            f"patchgen --check: {stale} generated file(s) are stale. Never edit generated/ by hand: change the "
            "patch config, then run `spindle patchgen` (or `spindle patchgen --check --fix`) and review the .diff",
            file=sys.stderr,
        )
        return 1
    if args.check:
        print(f"patchgen --check: {len(paths)} config(s) up to date")
    return 0
