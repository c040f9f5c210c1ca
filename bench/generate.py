"""Latency of Spindle's staged engine vs the checkpoint's diffusers pipeline (WanPipeline, FluxPipeline), side by side.

Same checkpoint, seed and parameters for every row. Modes:
  exact         Spindle `exact=True` (bit for bit the reference loop) vs diffusers
  default       Spindle's defaults (CFG batching, per-request prompt projections, oneDNN VAE convs) vs diffusers
  compile       regional torch.compile of the repeated blocks, both engines (warm-up not timed)
  cache         diffusers' first-block cache at each --thresholds value, both engines (PSNR vs exact)
  best          best vs best: Spindle default + compile + `cache="auto"` (calibrated at --min-psnr) vs
                diffusers + compile_repeated_blocks + the same cache hook and knobs (what a diffusers user
                who knows its speed options runs), both also against stock diffusers, interleaved
  sp2           Spindle, Ulysses sequence parallel over 2 processes (torchrun, gloo/nccl)
  cfg_parallel  Spindle, cond / uncond on 2 processes

Checkpoints are random (no downloads here) but Wan-shaped: `--preset cpu` is small enough for a
CPU and sized so that the DiT, not the VAE, dominates; `--preset wan1.3b` uses the Wan2.1-1.3B
transformer and VAE shapes (needs a GPU: 480x832, 81 frames); `--preset flux-cpu` / `flux-gpu` are
FLUX.1-shaped (true CFG with a negative prompt, so every mode applies). Prints a table and writes JSON.

  python bench/generate.py --preset cpu --json bench-generate.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

PRESETS = {
    "cpu": dict(
        transformer=dict(
            num_layers=8,
            num_attention_heads=8,
            attention_head_dim=32,
            ffn_dim=1024,
            in_channels=16,
            out_channels=16,
            freq_dim=64,
            rope_max_seq_len=256,
        ),
        vae=dict(base_dim=8, z_dim=16),
        text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        request=dict(height=128, width=128, num_frames=9, num_inference_steps=8, guidance_scale=5.0),
        dtype="float32",
    ),
    "wan1.3b": dict(  # Wan2.1-T2V-1.3B transformer + VAE shapes; a thin random text encoder of width 4096
        transformer=dict(
            num_layers=30,
            num_attention_heads=12,
            attention_head_dim=128,
            ffn_dim=8960,
            in_channels=16,
            out_channels=16,
            freq_dim=256,
            rope_max_seq_len=1024,
            eps=1e-6,
        ),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
        text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=2, num_heads=8),
        request=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
        dtype="bfloat16",
    ),
    # FLUX.1 (family "flux"): true CFG (true_cfg_scale + negative prompt) so the CFG modes apply too.
    "flux-cpu": dict(
        family="flux",
        transformer=dict(
            num_layers=4,
            num_single_layers=8,
            num_attention_heads=8,
            attention_head_dim=32,
            axes_dims_rope=(8, 12, 12),
            in_channels=16,
        ),
        vae=dict(block_out_channels=(8, 16)),  # x2: 96x96 px -> 48x48 latents -> 576 image tokens
        text_encoder_2=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        request=dict(
            height=96, width=96, num_inference_steps=6, guidance_scale=3.5, true_cfg_scale=4.0, max_sequence_length=64
        ),
        dtype="float32",
    ),
    "flux-gpu": dict(  # FLUX.1-dev block shapes (3072 wide, 24 heads x 128, VAE x8, 16 latent channels), 2+4 blocks
        family="flux",
        transformer=dict(
            num_layers=2,
            num_single_layers=4,
            num_attention_heads=24,
            attention_head_dim=128,
            axes_dims_rope=(16, 56, 56),
            in_channels=64,
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32),
        text_encoder=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12),
        text_encoder_2=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=2, num_heads=8),
        request=dict(
            height=1024,
            width=1024,
            num_inference_steps=28,
            guidance_scale=3.5,
            true_cfg_scale=4.0,
            max_sequence_length=512,
        ),
        dtype="bfloat16",
        vae_dtype="bfloat16",  # FluxPipeline decodes in the latents' dtype
    ),
    # Qwen-Image (family "qwenimage"): true CFG with the negative prompt (its default true_cfg_scale 4).
    "qwenimage-cpu": dict(
        family="qwenimage",
        transformer=dict(num_layers=6, num_attention_heads=8, attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
        vae=dict(base_dim=16),  # x2: 96x96 px -> 48x48 latents -> 576 image tokens
        text_encoder=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4),
        request=dict(height=96, width=96, num_inference_steps=6, true_cfg_scale=4.0, max_sequence_length=64),
        dtype="float32",
    ),
}
COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")  # per-preset overrides of the tiny builders
WARMUP_STEPS = 2  # one step is a NaN schedule for Qwen-Image's shift_terminal scheduler (a RequestError here)
PROMPT = dict(prompt="a red panda climbing a snowy tree, cinematic", negative_prompt="blurry, low quality")


def build_checkpoint(preset: str, root: Path) -> Path:
    from spindle.testing.tiny import build_tiny

    if (root / "model_index.json").is_file():
        return root
    p = PRESETS[preset]
    return build_tiny(p.get("family", "wan"), root, seed=0, **{k: p[k] for k in COMPONENTS if k in p})


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    from spindle.infer.generator import psnr as _psnr

    return _psnr(a, b)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


# ---------------------------------------------------------------- engines


def diffusers_pipe(root: Path, dtype: torch.dtype, device: str, vae_dtype: torch.dtype = torch.float32):
    """The checkpoint's own diffusers pipeline class (model_index.json), VAE in `vae_dtype`."""
    import diffusers

    index = json.loads((root / "model_index.json").read_text())
    vae = getattr(diffusers, index["vae"][1]).from_pretrained(root / "vae", dtype=vae_dtype)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(root, vae=vae, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe, req: dict, seed: int, steps: int | None = None) -> np.ndarray:
    kw = {**req, **({"num_inference_steps": steps} if steps else {})}
    if getattr(pipe.transformer, "is_cache_enabled", False):
        # diffusers' pipelines do not reset step-cache hooks per call (MagCache's step counter only wraps
        # at its configured step count): a fresh state per request, as Spindle's engine does
        pipe.transformer._reset_stateful_cache()
    out = pipe(**PROMPT, **kw, generator=torch.Generator().manual_seed(seed), output_type="np")
    return out.frames if hasattr(out, "frames") else out.images  # video / image pipelines


def run_spindle(gen, req: dict, seed: int, steps: int | None = None):
    kw = {**req, **({"num_inference_steps": steps} if steps else {})}
    return gen.generate(**PROMPT, **kw, seed=seed)


# ---------------------------------------------------------------- multi-process worker


def worker(args: argparse.Namespace) -> None:
    """Runs under torchrun: one Spindle multi-process mode; rank 0 writes timings + frames."""
    import torch.distributed as dist

    from spindle import DiffusionGenerator

    p = PRESETS[args.preset]
    options = json.loads(args.worker_options)
    gen = DiffusionGenerator.from_pretrained(
        args.root, dtype=p["dtype"], vae_dtype=p.get("vae_dtype", "float32"), **options
    )
    req = {**p["request"], **({"num_inference_steps": args.steps} if args.steps else {})}
    run_spindle(gen, req, args.seed, steps=WARMUP_STEPS)  # warm-up
    dt, res = timed(lambda: run_spindle(gen, req, args.seed), args.repeats)
    if dist.get_rank() == 0:
        np.save(args.worker_out + ".npy", res.frames)
        Path(args.worker_out + ".json").write_text(json.dumps({"total": dt, "timings": res.timings}))
    dist.destroy_process_group()


def run_multiprocess(args: argparse.Namespace, root: Path, options: dict, tag: str, out_dir: Path) -> dict:
    out = out_dir / tag
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        __file__,
        "--preset",
        args.preset,
        "--root",
        str(root),
        "--seed",
        str(args.seed),
        "--repeats",
        str(args.repeats),
        "--worker-options",
        json.dumps(options),
        "--worker-out",
        str(out),
    ]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{tag} failed:\n{r.stderr[-3000:]}")
    info = json.loads(Path(str(out) + ".json").read_text())
    info["frames"] = np.load(str(out) + ".npy")
    return info


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu" if not torch.cuda.is_available() else "wan1.3b")
    ap.add_argument("--root", default=None, help="checkpoint folder (built if missing; default: a temp folder)")
    ap.add_argument("--modes", default="exact,default,compile,cache,best,sp2,cfg_parallel")
    ap.add_argument("--thresholds", default="0.05,0.2", help="first-block cache thresholds")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's denoising steps")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    ap.add_argument("--min-psnr", type=float, default=30.0, help="best: the cache calibration's PSNR floor (dB)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads for both engines")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--worker-options", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_options is not None:
        return worker(args)

    import tempfile

    from spindle import DiffusionGenerator

    modes = args.modes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    p = PRESETS[args.preset]
    req = {**p["request"], **({"num_inference_steps": args.steps} if args.steps else {})}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[p["dtype"]]
    vae_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[p.get("vae_dtype", "float32")]
    tmp = Path(tempfile.mkdtemp(prefix="spindle-bench-"))
    root = build_checkpoint(args.preset, Path(args.root) if args.root else tmp / "ckpt")
    rows: list[dict] = []

    def add(mode: str, engine: str, total: float, frames: np.ndarray, baseline: float, **extra) -> None:
        row = {
            "mode": mode,
            "engine": engine,
            "total_s": round(total, 4),
            "baseline_s": round(baseline, 4),
            "max_abs_diff_vs_diffusers": float(np.abs(frames - ref).max()),
            "psnr_db_vs_diffusers_exact": float(psnr(frames, ref)),
            **extra,
        }
        rows.append(row)
        print(
            f"  {mode:<13} {engine:<9} {total:8.3f}s",
            {k: v for k, v in row.items() if k not in ("mode", "engine", "total_s")},
            flush=True,
        )

    def pair(mode: str, d_pipe, s_gen, stock=None, **extra) -> None:
        """Interleave diffusers and Spindle runs (ABAB...) so load changes on a shared machine hit both.
        `stock`: also interleave stock diffusers and report both engines against it."""
        d_times, s_times, k_times, d_out, s_out = [], [], [], None, None
        for _ in range(args.repeats):
            if stock is not None:
                t, _ = timed(lambda: run_diffusers(stock, req, args.seed), 1)
                k_times.append(t)
            t, d_out = timed(lambda: run_diffusers(d_pipe, req, args.seed), 1)
            d_times.append(t)
            t, s_out = timed(lambda: run_spindle(s_gen, req, args.seed), 1)
            s_times.append(t)
        d, s = statistics.median(d_times), statistics.median(s_times)
        stages = {k: round(v, 4) for k, v in s_out.timings.items()}
        add(mode, "diffusers", d, d_out, d)
        add(mode, "spindle", s, s_out.frames, d, stages=stages, **extra)
        if stock is not None:
            k = statistics.median(k_times)
            add(f"{mode}/stock", "diffusers", d, d_out, k, baseline_kind="stock diffusers")
            add(f"{mode}/stock", "spindle", s, s_out.frames, k, baseline_kind="stock diffusers", stages=stages)

    def spindle_gen(options: dict):
        gen = DiffusionGenerator.from_pretrained(
            root, dtype=p["dtype"], vae_dtype=p.get("vae_dtype", "float32"), **options
        )
        t = time.perf_counter()
        run_spindle(gen, req, args.seed, steps=WARMUP_STEPS)  # warm-up (compilation for --compile)
        return gen, time.perf_counter() - t

    print(f"preset {args.preset} on {device} ({torch.get_num_threads()} threads): {json.dumps(req)}", flush=True)
    pipe = diffusers_pipe(root, dtype, device, vae_dtype)
    run_diffusers(pipe, req, args.seed, steps=WARMUP_STEPS)  # warm-up
    ref = run_diffusers(pipe, req, args.seed)  # the exact reference output

    if "exact" in modes:
        pair("exact", pipe, spindle_gen({"exact": True})[0])
    if "default" in modes:
        pair("default", pipe, spindle_gen({})[0])
    if "compile" in modes:
        cpipe = diffusers_pipe(root, dtype, device, vae_dtype)
        cpipe.transformer.compile_repeated_blocks()
        t = time.perf_counter()
        run_diffusers(cpipe, req, args.seed, steps=WARMUP_STEPS)
        d_warm = time.perf_counter() - t
        gen, s_warm = spindle_gen({"compile": True})
        pair("compile", cpipe, gen, warmup_s=round(s_warm, 2), diffusers_warmup_s=round(d_warm, 2))
        del cpipe, gen
    if "best" in modes:
        from spindle.infer.caches import build_config

        t = time.perf_counter()
        gen = DiffusionGenerator.from_pretrained(
            root,
            dtype=p["dtype"],
            vae_dtype=p.get("vae_dtype", "float32"),
            compile=True,
            cache="auto",
            min_psnr=args.min_psnr,
        )
        run_spindle(gen, req, args.seed)  # calibration (+ compilation)
        s_setup = time.perf_counter() - t
        choice = gen.cache_choice
        print(f"  best: {choice.describe()} (setup {s_setup:.1f}s)", flush=True)
        bpipe = diffusers_pipe(root, dtype, device, vae_dtype)
        bpipe.transformer.compile_repeated_blocks()
        if choice.name is not None:  # diffusers with the very hook and knobs Spindle chose
            # MagCache counts steps against its configured schedule (diffusers' default 28): this request's
            options = {
                **choice.options,
                **({"num_inference_steps": req["num_inference_steps"]} if choice.name == "mag" else {}),
            }
            bpipe.transformer.enable_cache(
                build_config(choice.name, choice.threshold, options, lambda: bpipe.current_timestep)
            )
        run_diffusers(bpipe, req, args.seed, steps=1)  # compilation
        pair(
            "best",
            bpipe,
            gen,
            stock=pipe,
            cache=choice.name,
            cache_knob=choice.threshold,
            calibration_psnr=choice.psnr,
            setup_s=round(s_setup, 1),
        )
        del bpipe, gen
    if "cache" in modes:
        from diffusers.hooks import FirstBlockCacheConfig

        for thr in [float(x) for x in args.thresholds.split(",")]:
            cpipe = diffusers_pipe(root, dtype, device, vae_dtype)
            cpipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=thr))
            run_diffusers(cpipe, req, args.seed, steps=WARMUP_STEPS)
            pair(f"cache@{thr}", cpipe, spindle_gen({"cache": "fbc", "cache_threshold": thr})[0])
            del cpipe
    one_proc = None
    for mode, options in (("sp2", {"sp": 2}), ("cfg_parallel", {"cfg_parallel": True})):
        if mode in modes:
            if one_proc is None:
                one_proc = spindle_gen({"cfg_batch": True})[0]
            info = run_multiprocess(args, root, options, mode, tmp)
            # right after the multi-process run, so both see the same machine load
            single, _ = timed(functools.partial(run_spindle, one_proc, req, args.seed), args.repeats)
            add(
                mode,
                "spindle",
                info["total"],
                info["frames"],
                single,
                processes=2,
                baseline_kind="spindle 1 process",
                stages={k: round(v, 4) for k, v in info["timings"].items()},
            )

    print()
    header = (
        f"| {'mode':<13} | {'engine':<9} | {'total s':>8} | {'speed-up':>12} | {'max abs diff':>12} | {'PSNR dB':>7} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        diff = r.get("max_abs_diff_vs_diffusers")
        ps = r.get("psnr_db_vs_diffusers_exact")
        print(
            f"| {r['mode']:<13} | {r['engine']:<9} | {r['total_s']:>8.3f} | {r['baseline_s'] / r['total_s']:>11.2f}x | "
            f"{'-' if diff is None else f'{diff:.1e}':>12} | {'-' if ps is None else ('inf' if ps == float('inf') else f'{ps:.1f}'):>7} |"
        )
    print(
        "speed-up: vs the diffusers run of the same mode, timed interleaved with it (sp2 / cfg_parallel: vs "
        "Spindle in 1 process, timed right after); max abs diff / PSNR: vs diffusers' exact output"
    )
    result = {
        "preset": args.preset,
        "device": device,
        "threads": torch.get_num_threads(),
        "request": req,
        "torch": torch.__version__,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
