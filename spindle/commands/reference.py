"""docs/cli.md, generated from the parser: `spindle --help` and every `spindle COMMAND --help` (whose
engine and limit flags come from the typed sections' fields, `spindle.commands.flags`), at a fixed width.

  python -m spindle.commands.reference           # rewrite docs/cli.md
  python -m spindle.commands.reference --check   # exit 1 when docs/cli.md is stale (tests/project runs this check)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
WIDTH = 100  # columns argparse wraps the help at (it reads $COLUMNS)
INTRO = (
    "# Command-line reference\n\n"
    "Generated from `spindle COMMAND --help` by `python -m spindle.commands.reference` (the engine and limit "
    "flags\nfrom the fields of `spindle.engine_config`; `tests/project/test_option_sections.py` fails when this "
    "page is stale).\nEvery command fails on bad input with one line naming what is wrong (exit code 2).\n"
)


@contextmanager
def _columns(width: int) -> Iterator[None]:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def cli_reference() -> str:
    """The text of docs/cli.md."""
    from spindle.cli import build_parser

    with _columns(WIDTH):
        parser = build_parser()
        parts = [INTRO, f"```\n{parser.format_help()}```\n"]
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, command in sub.choices.items():
            parts.append(f"## spindle {name}\n\n```\n{command.format_help()}```\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spindle.commands.reference", description=__doc__)
    p.add_argument("--check", action="store_true", help="only check that docs/cli.md is up to date")
    args = p.parse_args(argv)
    text = cli_reference()
    if args.check:
        if DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m spindle.commands.reference", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
