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

from spindle.commands.engine_args import add_engine_arguments, check_family_parallel, check_world_size, engine_config
from spindle.contracts.options import FamilyOptions
from spindle.infer.options import add_option_arguments, guidance_help, option_values
from spindle.registry import all_families

HELP = "generate a video/image from a diffusers checkpoint (staged engine)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="diffusers pipeline folder (with model_index.json), or a Hugging Face repo id org/name[@revision] "
        "in the local cache",
    )
    p.add_argument("--prompt", required=True, help="text prompt")
    p.add_argument(
        "--negative-prompt",
        default=None,
        help="negative prompt (classifier-free guidance: see --guidance and the family options)",
    )
    p.add_argument("--height", type=int, default=None, help="height in pixels (family default if omitted)")
    p.add_argument("--width", type=int, default=None, help="width in pixels")
    p.add_argument("--num-frames", type=int, default=None, help="number of frames (video families)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps")
    p.add_argument("--guidance", type=float, default=None, help=f"guidance_scale; {guidance_help(all_families())}")
    p.add_argument("--seed", type=int, default=None, help="seed (random if omitted; printed)")
    p.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="conditioning image file (image-to-video: the first frame); repeat for families taking several",
    )
    p.add_argument(
        "--last-image",
        default=None,
        metavar="PATH",
        help="the last frame's image file (first-last-frame video families, Wan FLF2V; with one --image)",
    )
    p.add_argument("--out", required=True, help="output file: .mp4 for video, .png for images")
    p.add_argument("--fps", type=int, default=None, help="frames per second of the mp4 (default: the family's)")
    p.add_argument(
        "--no-psnr",
        dest="psnr",
        action="store_false",
        help="with --cache: skip the exact reference run that measures PSNR",
    )
    add_option_arguments(p, all_families())  # the families' declared sampling options (--true-cfg-scale, ...)
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
    """`--out`'s extension against what the family writes, and the conditioning images it requires (present,
    existing files), from the folder's family record alone: a `ValueError` / `FileNotFoundError` naming the
    flag before any weight loads."""
    from pathlib import Path

    from spindle.registry import dit_family_of

    family = dit_family_of(args.model)
    options = family.options
    suffix = Path(args.out).suffix.lower()
    allowed = output_suffixes(options, args.num_frames)
    if suffix not in allowed:
        what = "a video (or with --num-frames 1, an image)" if options.fps is not None else "an image"
        raise ValueError(
            f"--out {args.out}: {family.name} generates {what}; give a file ending in {' / '.join(allowed)}"
        )
    low = options.images[0]
    given = [*(args.image or []), *([args.last_image] if args.last_image else [])]
    if args.last_image is not None and len(args.image or []) != 1:
        raise ValueError("--last-image goes with exactly one --image (the first frame)")
    if low and not args.image:
        raise ValueError(
            f"--image is required for {family.name}: give {low} conditioning image file(s) "
            f"(--image PATH{', repeated' if low > 1 else ''})"
        )
    for path in given:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--image: image file {str(path)!r} does not exist")


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
    images = args.image
    if args.last_image is not None:  # the request's second image (generate()'s last_image)
        if len(images or []) != 1:
            from spindle.contracts.request import RequestError

            raise RequestError("--last-image goes with exactly one --image (the first frame)", field="last_image")
        images = [*images, args.last_image]
    request = dict(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
        image=images,
        **option_values(args),
    )
    if gen.spec.media != "video":
        request.pop("num_frames")
    if args.cache == "auto":
        from spindle.contracts.request import SamplingParams

        calib = time.perf_counter()
        choice = gen.calibrate_cache(SamplingParams(**{**request, "extra": {}}))
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

    if main:  # what is about to run, defaults included (a video's default size and length can take long)
        from spindle.contracts.request import SamplingParams

        common = {k: v for k, v in request.items() if k not in option_values(args)}
        planned = gen.validate(SamplingParams(**common, extra=option_values(args)))
        frames = f", {planned.num_frames} frames" if gen.spec.media == "video" else ""
        print(
            f"generating {planned.width}x{planned.height}{frames}, {planned.num_inference_steps} steps "
            f"(--width/--height/--num-frames/--steps change it)",
            file=sys.stderr,
        )
    result = gen.generate(**request, progress=progress)
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
