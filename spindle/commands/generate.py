"""Generate a video (or image) from a diffusers checkpoint with Spindle's staged engine.

  spindle generate --model PATH --prompt "a cat surfing" --height 480 --width 832 \\
      --num-frames 81 --steps 50 --guidance 5 --seed 0 --out out.mp4

Speed options: the exact ones are on by default (CFG batching, per-request prompt projections,
oneDNN VAE convolutions; --exact turns them off and reproduces diffusers bit for bit); --compile
(torch.compile of the repeated transformer blocks, after a warm-up run that is not timed); --cache
NAME [--cache-threshold T] [--cache-option K=V] (diffusers' cache hooks; prints PSNR against the
uncached output unless --no-psnr); --cache auto --min-psnr 30 (calibrates on the request, prints the
choice); --nproc N --sp S / --cfg-parallel (multi-process Ulysses SP / CFG parallel, via torchrun).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from spindle.commands.engine_args import add_engine_arguments, check_family_parallel, check_world_size, engine_config
from spindle.commands.flags import add_sampling_arguments, sampling_values
from spindle.contracts.options import FamilyOptions
from spindle.infer.options import guidance_help
from spindle.registry import all_families

HELP = "generate a video/image from a diffusers checkpoint (staged engine)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="diffusers pipeline folder (with model_index.json), or a Hugging Face repo id org/name[@revision] "
        "in the local cache",
    )
    p.add_argument("--out", required=True, help="output file: .mp4 for video, .png for images")
    p.add_argument("--fps", type=int, default=None, help="frames per second of the mp4 (default: the family's)")
    p.add_argument(
        "--no-psnr",
        dest="psnr",
        action="store_false",
        help="with --cache: skip the exact reference run that measures PSNR",
    )
    # the sampling flags, from the families' sampling schemas (--prompt, --steps, ..., --true-cfg-scale, ...)
    add_sampling_arguments(p, all_families(), notes={"guidance_scale": guidance_help(all_families())})
    add_engine_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def output_suffixes(options: FamilyOptions, num_frames: int | None) -> list[str]:
    """The `--out` file types a family's generation can be written as: a video family (it declares its frame rate,
    `FamilyOptions.fps`; LTX-2's frame rule depends on the checkpoint's VAE, so not every one declares
    `frame_multiple`) writes .mp4, and with `--num-frames 1` an image too; an image family writes images."""
    from spindle.data.media import IMAGE_EXTENSIONS

    images = sorted(IMAGE_EXTENSIONS - {".bmp"})
    if options.fps is None:
        return images
    return [".mp4", *(images if num_frames == 1 else [])]


def check_request_files(args: argparse.Namespace) -> None:
    """`--out`'s extension against what the family writes, and the conditioning images by the family's rule (as
    many as it takes, existing image files), from the folder's family record alone: a `ValueError` (the images': a
    `RequestError`) naming the flag before any weight loads."""
    from pathlib import Path

    from spindle.contracts.images import request_images
    from spindle.registry import dit_family_of

    family = dit_family_of(args.model)
    options = family.options
    values = sampling_values(args)
    suffix = Path(args.out).suffix.lower()
    allowed = output_suffixes(options, values.get("num_frames"))
    if suffix not in allowed:
        what = "a video (or with --num-frames 1, an image)" if options.fps is not None else "an image"
        raise ValueError(
            f"--out {args.out}: {family.name} generates {what}; give a file ending in {' / '.join(allowed)}"
        )
    # the images by the family's own rule (the engine's and the server's: contracts/images.request_images), files
    # checked by their headers, nothing decoded
    request_images(
        values.get("image"),
        values.get("last_image"),
        options.images,
        family.name,
        names=("--image", "--last-image"),
        how=f"(--image PATH{', repeated' if options.images[0] > 1 else ''})",
        decode=False,
    )


def params_of(request: dict[str, Any], gen: Any) -> Any:
    """The flags' values as the engine's `SamplingParams` (the family's options in `extra`; `--last-image` after
    the `--image`): validated by the family's schema where they run."""
    from spindle.contracts.images import with_last_image
    from spindle.contracts.request import SamplingParams

    values = dict(request)
    options = {k: values.pop(k) for k in gen.options.names() if k in values}
    values["image"] = with_last_image(values.get("image"), values.pop("last_image", None))
    return SamplingParams(**values, extra=options)


def _format_timings(timings: dict[str, float]) -> str:
    parts = [f"{k} {v:.2f}s" for k, v in timings.items()]
    return "time: " + ", ".join(parts) + f" | total {sum(timings.values()):.2f}s"


def run(args: argparse.Namespace) -> int:
    from spindle.distributed.launch import maybe_relaunch
    from spindle.hub import resolve_model_path

    engine = engine_config(args)  # bad engine flags fail here, before a launch or a load
    args.model = resolve_model_path(args.model, "--model")  # a Hugging Face repo id: its cached snapshot
    check_family_parallel(args)  # --sp / --ring against the family and its transformer, before a launch
    check_request_files(args)  # --out and --image, before a launch or a load
    nproc, _ = check_world_size(args)
    code = maybe_relaunch(nproc, args._argv)  # parent of --nproc N > 1: re-run under torchrun
    if code is not None:
        return code

    from spindle.infer.pipeline import is_main_rank
    from spindle.infer.quality import psnr

    start = time.perf_counter()
    from spindle.api import load_generator

    gen = load_generator(args.model, **dict(engine))
    load_s = time.perf_counter() - start
    # after loading: a multi-process engine joins its process group there, and only rank 0 writes the output
    # (every rank writing the same file raced on its atomic rename)
    main = is_main_rank()
    request = sampling_values(args)  # checked by the family's schema when it runs (one validation)
    if gen.spec.media != "video":
        request.pop("num_frames", None)
    if args.cache == "auto":
        calib = time.perf_counter()
        choice = gen.calibrate_cache(params_of(request, gen))
        if main:
            for t in choice.trials:
                print(
                    f"  calibration: {t['name']} {t['threshold']}: PSNR {t['psnr']:.2f} dB, denoising {t['seconds']:.2f}s"
                )
            print(choice.describe() + f" [calibration {time.perf_counter() - calib:.2f}s]")
    if args.compile:
        warm = time.perf_counter()
        gen.generate(**{**request, "num_inference_steps": 1, "seed": 0})
        if main:
            print(f"compile warm-up: {time.perf_counter() - warm:.2f}s (not counted below)", file=sys.stderr)

    bar = None
    if main and not args.quiet:
        from tqdm import tqdm

        bar = tqdm(total=None, desc="denoising", unit="step", file=sys.stderr)

    def progress(step: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(step - bar.n)

    planned = gen.validated(params_of(request, gen))  # on every rank (a seed drawn if none: the same on each)
    if main:  # what is about to run, defaults included (a video's default size and length can take long)
        p = planned.params
        frames = f", {p.num_frames} frames" if gen.spec.media == "video" else ""
        print(
            f"generating {p.width}x{p.height}{frames}, {p.num_inference_steps} steps "
            f"(--width/--height/--num-frames/--steps change it)",
            file=sys.stderr,
        )
    result = gen.run(planned, progress=progress)  # validated once, run as it is
    if bar is not None:
        bar.close()
    if not main:
        return 0
    paths = result.save(args.out, fps=args.fps or gen.spec.fps)
    shape = "x".join(str(s) for s in result.frames.shape)
    print(f"wrote {', '.join(str(p) for p in paths)} ({shape}, seed {result.seed}, family {gen.family})")
    cache = gen.pipeline.denoising.cache
    if cache is not None and args.psnr:
        if nproc == 1:
            described = cache.describe()
            gen.pipeline.denoising.set_cache(None)
            exact = gen.generate(**{**request, "seed": result.seed})
            print(
                f"cache {described}: PSNR "
                f"{psnr(result.frames, exact.frames):.2f} dB vs uncached; denoising {result.timings['denoising']:.2f}s "
                f"cached vs {exact.timings['denoising']:.2f}s uncached"
            )
        else:
            print("cache: PSNR vs exact is reported for single-process runs only (run with --nproc 1)")
    print(f"load {load_s:.2f}s | " + _format_timings(result.timings))
    return 0
