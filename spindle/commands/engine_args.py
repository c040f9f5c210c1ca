"""Engine options shared by `spindle generate` and `spindle serve`: one definition, one validation."""

from __future__ import annotations

import argparse
import ast
from typing import Any

from spindle.infer.caches import CACHE_NAMES


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument("--device", default=None, help="cpu / cuda (default: cuda if available)")
    g.add_argument("--dtype", default="float32", help="transformer + text encoder dtype (float32, bfloat16)")
    g.add_argument(
        "--exact",
        action="store_true",
        help="reproduce diffusers bit for bit: turn off the default speed-ups (CFG batching, per-request prompt "
        "projections, oneDNN VAE convolutions and feed-forward Linear + GELU); cannot be combined with --compile "
        "or --cache",
    )
    g.add_argument(
        "--no-cfg-batch",
        dest="cfg_batch",
        action="store_false",
        help="run conditional and unconditional as two forwards (default: one batched forward)",
    )
    g.add_argument(
        "--no-keep-freed-memory",
        dest="keep_freed_memory",
        action="store_false",
        help="on CPU, let glibc hand freed memory back to the OS (default: keep it in the process so tensors "
        "are not page-faulted in again at every step; the output is the same)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the repeated transformer blocks")
    g.add_argument(
        "--cache",
        choices=CACHE_NAMES,
        default=None,
        help="step cache (diffusers hooks): fbc = first-block cache, mag = MagCache, taylorseer = TaylorSeer, "
        "pab = pyramid attention broadcast, faster = FasterCache; auto = calibrate on the request and pick the "
        "fastest policy above --min-psnr",
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help="the cache's main knob: fbc/mag threshold (higher: faster, lossier), taylorseer cache_interval, "
        "pab/faster spatial_attention_block_skip_range (default: the policy's)",
    )
    g.add_argument(
        "--cache-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another knob of the cache's diffusers config, e.g. max_skip_steps=2 (repeatable)",
    )
    g.add_argument(
        "--min-psnr", type=float, default=30.0, help="--cache auto: quality floor in dB vs the uncached output"
    )
    g.add_argument("--nproc", type=int, default=1, help="processes to launch (re-launches via torchrun)")
    g.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (heads must divide it)")
    g.add_argument(
        "--ring", type=int, default=1, help="ring-attention degree; the sequence is split over ring x sp processes"
    )
    g.add_argument("--cfg-parallel", action="store_true", help="conditional / unconditional on different ranks")
    g.add_argument("--lora", default=None, help="LoRA .safetensors file or folder (diffusers, ComfyUI/original layout)")
    g.add_argument("--lora-scale", type=float, default=1.0, help="LoRA strength (default 1.0)")
    g.add_argument(
        "--blocks-to-swap",
        type=int,
        default=0,
        metavar="N",
        help="keep the last N transformer blocks in host memory and stream them to the device with prefetch "
        "(for models bigger than the device; same output)",
    )
    g.add_argument(
        "--text-encoder-offload", action="store_true", help="text encoders on the host, on the device only to encode"
    )
    g.add_argument("--vae-tiling", action="store_true", help="tiled (and sliced) VAE decoding, diffusers' own")


def parse_cache_options(items: list[str]) -> dict[str, Any]:
    """`["max_skip_steps=2", "spatial_attention_timestep_skip_range=(100, 900)"]` -> dict (Python literals;
    anything else stays a string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--cache-option takes KEY=VALUE (e.g. max_skip_steps=2); got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def engine_options(args: argparse.Namespace) -> dict:
    """The `spindle.api.load_generator` keyword arguments the flags above stand for."""
    return dict(
        device=args.device,
        dtype=args.dtype,
        exact=args.exact,
        cfg_batch=args.cfg_batch,
        keep_freed_memory=args.keep_freed_memory,
        compile=args.compile,
        cache=args.cache,
        cache_threshold=args.cache_threshold,
        cache_options=parse_cache_options(args.cache_option),
        min_psnr=args.min_psnr,
        sp=args.sp,
        ring=args.ring,
        cfg_parallel=args.cfg_parallel,
        lora=args.lora,
        lora_scale=args.lora_scale,
        blocks_to_swap=args.blocks_to_swap,
        text_encoder_offload=args.text_encoder_offload,
        vae_tiling=args.vae_tiling,
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
