"""`spindle --help` and every `spindle COMMAND --help` answer without importing torch, diffusers or
transformers (the parser reads the limits, the families' options and the cache names from light
modules; the heavy imports happen in each command's `run`)."""

from __future__ import annotations

import subprocess
import sys

from spindle.cli import COMMANDS

HEAVY = ("torch", "diffusers", "transformers")


def heavy_imports(importtime_log: str) -> set[str]:
    """The heavy packages named in `python -X importtime` output (one line per imported module)."""
    found = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            module = line.rsplit("|", 1)[1].strip()
            if module.split(".")[0] in HEAVY:
                found.add(module.split(".")[0])
    return found


def test_help_imports_no_torch_and_names_every_command():
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "spindle", *([name] if name else []), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("", *COMMANDS)
    }
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        what = f"spindle {name} --help".replace("  ", " ")
        assert proc.returncode == 0, f"{what}: {err[-2000:]}"
        # the importtime log proves it measures: spindle itself is in it
        assert "spindle.cli" in err, f"{what}: no -X importtime output"
        assert heavy_imports(err) == set(), f"{what} imported {heavy_imports(err)}"
        if name:
            assert out.startswith(f"usage: spindle {name}"), out[:200]
        else:
            listed = {line.split()[0] for line in out.splitlines() if line.startswith("    ") and line.strip()}
            assert set(COMMANDS) <= listed, f"spindle --help does not list {set(COMMANDS) - listed}:\n{out}"
    # the serve command's help shows the limit defaults it read without torch
    serve_help = subprocess.run(
        [sys.executable, "-m", "spindle", "serve", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for option in ("--max-pixels", "--max-connections", "--max-results", "--max-body-bytes"):
        assert option in serve_help, option
