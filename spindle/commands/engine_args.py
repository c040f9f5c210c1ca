"""Engine options shared by `spindle generate` and `spindle serve`: one definition, one validation."""

from __future__ import annotations

import argparse


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    g.add_argument("--dtype", default="float32", help="transformer + text encoder dtype (float32, bfloat16)")
    g.add_argument(
        "--no-cfg-batch",
        dest="cfg_batch",
        action="store_false",
        help="run conditional and unconditional as two forwards (default: one batched forward)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the repeated transformer blocks")
    g.add_argument("--cache", choices=["fbc"], default=None, help="step caching: fbc = first-block cache")
    g.add_argument("--cache-threshold", type=float, default=0.05, help="cache threshold (higher: faster, lossier)")
    g.add_argument("--nproc", type=int, default=1, help="processes to launch (re-launches via torchrun)")
    g.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (heads must divide it)")
    g.add_argument(
        "--ring", type=int, default=1, help="ring-attention degree; the sequence is split over ring x sp processes"
    )
    g.add_argument("--cfg-parallel", action="store_true", help="conditional / unconditional on different ranks")
    g.add_argument("--lora", default=None, help="LoRA .safetensors file or folder (diffusers, ComfyUI/original layout)")
    g.add_argument("--lora-scale", type=float, default=1.0, help="LoRA strength (default 1.0)")


def engine_options(args: argparse.Namespace) -> dict:
    """The `DiffusionGenerator.from_pretrained` keyword arguments the flags above stand for."""
    return dict(
        device=args.device,
        dtype=args.dtype,
        cfg_batch=args.cfg_batch,
        compile=args.compile,
        cache=args.cache,
        cache_threshold=args.cache_threshold,
        sp=args.sp,
        ring=args.ring,
        cfg_parallel=args.cfg_parallel,
        lora=args.lora,
        lora_scale=args.lora_scale,
    )


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
