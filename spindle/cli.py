"""`spindle` command line: one entry point, one module per subcommand under spindle/commands/.

Each command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module. Modules import lazily so `spindle --help` stays fast.
COMMANDS: dict[str, str] = {
    "train": "spindle.commands.train",
    "export": "spindle.commands.export",
    "tiny-model": "spindle.commands.tiny_model",
    "generate": "spindle.commands.generate",
    "demo": "spindle.commands.demo",
    "serve": "spindle.commands.serve",
    "patchgen": "spindle.commands.patchgen",
    "precompute": "spindle.commands.precompute",
    "plot": "spindle.commands.plot",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spindle",
        description="Train and serve diffusion transformers from standard diffusers checkpoints.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_path in COMMANDS.items():
        module = importlib.import_module(module_path)
        p = sub.add_parser(
            name, help=module.HELP, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(p)
        p.add_argument(
            "--verbose", action="store_true", help="show the libraries' own logs, progress bars and warnings"
        )
        p.set_defaults(_module=module)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse, plus dotted overrides anywhere: `spindle train CONFIG --nproc 2 key=value` (argparse alone
    stops filling `overrides` at the first flag and calls what follows unrecognized)."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.parse_args(argv)  # argparse's own message for what is really unrecognized (exit 2)
    return args


def user_frames(error: BaseException | None) -> str:
    """The traceback of an error raised in the user's code (a reward function), without Spindle's and the
    libraries' frames: where in their file it failed."""
    import traceback
    from pathlib import Path

    if error is None or error.__traceback__ is None:
        return ""
    ours = str(Path(__file__).resolve().parent)
    frames = [
        f
        for f in traceback.extract_tb(error.__traceback__)
        if not f.filename.startswith(ours) and "site-packages" not in f.filename
    ]
    if not frames:
        return ""
    return "".join(["in your code:\n", *traceback.format_list(frames)])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # for commands that re-launch themselves
    if args.command is None:
        parser.print_help()
        return 2
    if not args.verbose:
        from spindle.quiet import quiet_libraries

        quiet_libraries(loads_models=getattr(args._module, "LOADS_MODELS", True))
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (FileNotFoundError, ValueError) as e:  # user errors: one clear line, no traceback
        print(f"spindle {args.command}: error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # a full disk, also inside DCP's CheckpointException (a BaseException)
        from spindle.distributed.integrity import is_disk_full

        if getattr(e, "user_code", False):  # the user's own code failed (a reward): its message, then its frames
            print(f"spindle {args.command}: error: {e}", file=sys.stderr)
            print(user_frames(e.__cause__), file=sys.stderr, end="")
            return 1
        if not is_disk_full(e):
            raise
        print(f"spindle {args.command}: error: {e}", file=sys.stderr)  # ours say where, and what to do
        return 1


if __name__ == "__main__":
    sys.exit(main())
