"""`make lint` and `make typecheck` (the gates `make test` runs first) fail on one planted bad line,
naming its file and line, and pass again once it is gone. They run through the real Makefile on a
temporary copy of the tree, with this interpreter's environment (no venv set up in the copy)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# .mypy_cache is copied when there is one (make test has just run mypy on this tree): copies keep the
# files' mtimes, so mypy re-checks only the planted module and what imports it
IGNORE = shutil.ignore_patterns(".git", ".venv", "__pycache__", ".ruff_cache", "demo_out", "outputs")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("gates") / "spindle"
    shutil.copytree(ROOT, copy, ignore=IGNORE)
    return copy


def make(tree: Path, target: str) -> subprocess.CompletedProcess:
    # VENV = this interpreter's environment and no STAMP prerequisite: the targets' own commands run
    venv = Path(sys.executable).parent.parent
    return subprocess.run(
        ["make", "-s", target, f"VENV={venv}", "STAMP="], cwd=tree, capture_output=True, text=True, timeout=600
    )


class Planted:
    """Append `line` to `path` for the duration of a `with` block."""

    def __init__(self, tree: Path, path: str, line: str):
        self.file, self.line = tree / path, line

    def __enter__(self) -> int:
        self.original = self.file.read_text()
        self.file.write_text(self.original + self.line + "\n")
        return self.original.count("\n") + 1  # the planted line's number

    def __exit__(self, *exc) -> None:
        self.file.write_text(self.original)


def test_lint_fails_on_a_planted_hazard_and_a_misformatted_line(tree):
    # a silent `except: pass` (S110/E722) in a core module
    with Planted(tree, "spindle/registry.py", "try:\n    import os\nexcept:\n    pass") as n:
        out = make(tree, "lint")
    assert out.returncode != 0
    assert f"spindle/registry.py:{n + 2}" in out.stdout and "E722" in out.stdout, out.stdout + out.stderr
    # style only: ruff check is clean, ruff format --check is not
    with Planted(tree, "tests/conftest.py", "X = [ 1,2 ]") as n:
        out = make(tree, "lint")
    assert out.returncode != 0 and "All checks passed!" in out.stdout
    assert f"--> tests/conftest.py:{n}:1" in out.stdout and "1 file would be reformatted" in out.stdout, out.stdout
    ok = make(tree, "lint")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_typecheck_fails_on_a_planted_type_error_and_is_strict_on_the_core(tree):
    with Planted(tree, "spindle/distributed/launch.py", "def _bad(x: int) -> str:\n    return x") as n:
        out = make(tree, "typecheck")
    assert out.returncode != 0
    assert f"spindle/distributed/launch.py:{n + 1}: error: Incompatible return value type" in out.stdout, out.stdout
    # the core is strict: an unannotated function fails there, and passes in a lenient module
    with Planted(tree, "spindle/distributed/launch.py", "def _untyped(x):\n    return x") as n:
        out = make(tree, "typecheck")
    assert out.returncode != 0
    assert f"spindle/distributed/launch.py:{n}: error: Function is missing a type annotation" in out.stdout, out.stdout
    with Planted(tree, "spindle/data/synthetic.py", "def _untyped(x):\n    return x"):
        lenient = make(tree, "typecheck")
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
