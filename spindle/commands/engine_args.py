"""Engine options shared by `spindle generate` and `spindle serve`: the flags are generated from
`spindle.engine_config.EngineConfig`'s fields (one definition, one validation), plus `--nproc`."""

from __future__ import annotations

import argparse

from spindle.commands.flags import add_section_arguments, section_from_args
from spindle.engine_config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (spindle.engine_config.EngineConfig)")
    add_section_arguments(g, EngineConfig)
    g.add_argument("--nproc", type=int, default=1, help="processes to launch (re-launches via torchrun)")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options the flags stand for, validated (a bad one raises naming its flag)."""
    config: EngineConfig = section_from_args(args, EngineConfig)
    return config


def check_world_size(args: argparse.Namespace) -> tuple[int, bool]:
    """-> (world size, already under a launcher). The processes must be exactly sp x ring (x 2 with CFG parallel)."""
    from spindle.distributed.launch import launcher_world_size

    launched_world = launcher_world_size()
    launched = launched_world is not None
    world = launched_world if launched else args.nproc
    needed = args.sp * args.ring * (2 if args.cfg_parallel else 1)
    if world != needed:
        raise ValueError(
            f"{'the world size' if launched else '--nproc'} {world} does not match --sp {args.sp} x --ring {args.ring}"
            f"{' x 2 (--cfg-parallel)' if args.cfg_parallel else ''} = {needed} processes"
        )
    return world, launched


def check_family_parallel(args: argparse.Namespace) -> None:
    """`--sp` / `--ring` > 1 against the model's family and transformer, from the folder alone (before a launch or
    a load), as training checks `parallel.sp` / `parallel.ring` (`check_family_sequence_parallel`)."""
    if args.sp * args.ring == 1:
        return
    from spindle.distributed.context_parallel import check_family_sequence_parallel
    from spindle.registry import dit_family_of

    check_family_sequence_parallel(dit_family_of(args.model), args.model, args.sp, args.ring, ("--sp {}", "--ring {}"))
