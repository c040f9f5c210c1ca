"""Latency of Spindle's staged engine vs diffusers' WanPipeline, side by side in one run.

Same checkpoint, seed and parameters for every row. Modes:
  exact         Spindle with two forwards per step (bit-for-bit the reference loop) vs diffusers
  cfg_batch     Spindle, cond + uncond in one forward (the default)
  compile       regional torch.compile of the repeated blocks, both engines (warm-up not timed)
  cache         diffusers' first-block cache at each --thresholds value, both engines (PSNR vs exact)
  sp2           Spindle, Ulysses sequence parallel over 2 processes (torchrun, gloo/nccl)
  cfg_parallel  Spindle, cond / uncond on 2 processes

Checkpoints are random (no downloads here) but Wan-shaped: `--preset cpu` is small enough for a
CPU and sized so that the DiT, not the VAE, dominates; `--preset wan1.3b` uses the Wan2.1-1.3B
transformer and VAE shapes (needs a GPU: 480x832, 81 frames). Prints a table and writes JSON.

  python bench/generate.py --preset cpu --json bench-generate.json
"""

from __future__ import annotations

import argparse
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
        transformer=dict(num_layers=8, num_attention_heads=8, attention_head_dim=32, ffn_dim=1024, in_channels=16,
                         out_channels=16, freq_dim=64, rope_max_seq_len=256),
        vae=dict(base_dim=8, z_dim=16),
        text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        request=dict(height=96, width=96, num_frames=5, num_inference_steps=6, guidance_scale=5.0),
        dtype="float32",
    ),
    "wan1.3b": dict(  # Wan2.1-T2V-1.3B transformer + VAE shapes; a thin random text encoder of width 4096
        transformer=dict(num_layers=30, num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, in_channels=16,
                         out_channels=16, freq_dim=256, rope_max_seq_len=1024, eps=1e-6),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
        text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=2, num_heads=8),
        request=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
        dtype="bfloat16",
    ),
}
PROMPT = dict(prompt="a red panda climbing a snowy tree, cinematic", negative_prompt="blurry, low quality")


def build_checkpoint(preset: str, root: Path) -> Path:
    from spindle.testing.tiny import build_tiny_wan

    if (root / "model_index.json").is_file():
        return root
    p = PRESETS[preset]
    return build_tiny_wan(root, seed=0, transformer=p["transformer"], vae=p["vae"], text_encoder=p["text_encoder"])


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


def diffusers_pipe(root: Path, dtype: torch.dtype, device: str):
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(root / "vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(root, vae=vae, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe, req: dict, seed: int, steps: int | None = None) -> np.ndarray:
    kw = {**req, **({"num_inference_steps": steps} if steps else {})}
    return pipe(**PROMPT, **kw, generator=torch.Generator().manual_seed(seed), output_type="np").frames


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
    gen = DiffusionGenerator.from_pretrained(args.root, dtype=p["dtype"], **options)
    req = {**p["request"], **({"num_inference_steps": args.steps} if args.steps else {})}
    run_spindle(gen, req, args.seed, steps=1)  # warm-up
    dt, res = timed(lambda: run_spindle(gen, req, args.seed), args.repeats)
    if dist.get_rank() == 0:
        np.save(args.worker_out + ".npy", res.frames)
        Path(args.worker_out + ".json").write_text(json.dumps({"total": dt, "timings": res.timings}))
    dist.destroy_process_group()


def run_multiprocess(args: argparse.Namespace, root: Path, options: dict, tag: str, out_dir: Path) -> dict:
    out = out_dir / tag
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--preset", args.preset, "--root", str(root), "--seed", str(args.seed), "--repeats", str(args.repeats),
           "--worker-options", json.dumps(options), "--worker-out", str(out)]
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
    ap.add_argument("--modes", default="exact,cfg_batch,compile,cache,sp2,cfg_parallel")
    ap.add_argument("--thresholds", default="0.05,0.2", help="first-block cache thresholds")
    ap.add_argument("--steps", type=int, default=None, help="override the preset's denoising steps")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row (median)")
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
    p = PRESETS[args.preset]
    req = {**p["request"], **({"num_inference_steps": args.steps} if args.steps else {})}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[p["dtype"]]
    tmp = Path(tempfile.mkdtemp(prefix="spindle-bench-"))
    root = build_checkpoint(args.preset, Path(args.root) if args.root else tmp / "ckpt")
    rows: list[dict] = []

    def add(mode: str, engine: str, total: float, frames: np.ndarray, ref: np.ndarray | None, **extra) -> None:
        row = {"mode": mode, "engine": engine, "total_s": round(total, 4), **extra}
        if ref is not None:
            row["max_abs_diff_vs_diffusers"] = float(np.abs(frames - ref).max())
            row["psnr_db_vs_diffusers_exact"] = float(psnr(frames, ref))
        rows.append(row)
        print(f"  {mode:<13} {engine:<9} {total:8.3f}s", {k: v for k, v in row.items() if k not in ("mode", "engine", "total_s")},
              flush=True)

    print(f"preset {args.preset} on {device} ({torch.get_num_threads()} threads): {json.dumps(req)}", flush=True)
    pipe = diffusers_pipe(root, dtype, device)
    run_diffusers(pipe, req, args.seed, steps=1)  # warm-up
    t_ref, ref = timed(lambda: run_diffusers(pipe, req, args.seed), args.repeats)
    add("exact", "diffusers", t_ref, ref, None)

    def spindle_row(mode: str, options: dict, warm: bool = True) -> tuple[float, object]:
        gen = DiffusionGenerator.from_pretrained(root, dtype=p["dtype"], **options)
        if warm:
            run_spindle(gen, req, args.seed, steps=1)
        dt, res = timed(lambda: run_spindle(gen, req, args.seed), args.repeats)
        add(mode, "spindle", dt, res.frames, ref, stages={k: round(v, 4) for k, v in res.timings.items()})
        return dt, res

    if "exact" in modes:
        spindle_row("exact", {"cfg_batch": False})
    if "cfg_batch" in modes:
        spindle_row("cfg_batch", {"cfg_batch": True})
    if "compile" in modes:
        pipe.transformer.compile_repeated_blocks()
        t = time.perf_counter()
        run_diffusers(pipe, req, args.seed, steps=1)
        warm = time.perf_counter() - t
        dt, frames = timed(lambda: run_diffusers(pipe, req, args.seed), args.repeats)
        add("compile", "diffusers", dt, frames, ref, warmup_s=round(warm, 2))
        del pipe
        pipe = diffusers_pipe(root, dtype, device)
        spindle_row("compile", {"compile": True})
    if "cache" in modes:
        from diffusers.hooks import FirstBlockCacheConfig

        for thr in [float(x) for x in args.thresholds.split(",")]:
            pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=thr))
            run_diffusers(pipe, req, args.seed, steps=1)
            dt, frames = timed(lambda: run_diffusers(pipe, req, args.seed), args.repeats)
            add(f"cache@{thr}", "diffusers", dt, frames, ref)
            pipe.transformer.disable_cache()
            spindle_row(f"cache@{thr}", {"cache": "fbc", "cache_threshold": thr})
    for mode, options in (("sp2", {"sp": 2}), ("cfg_parallel", {"cfg_parallel": True})):
        if mode in modes:
            info = run_multiprocess(args, root, options, mode, tmp)
            add(mode, "spindle", info["total"], info["frames"], ref, processes=2,
                stages={k: round(v, 4) for k, v in info["timings"].items()})

    print()
    header = f"| {'mode':<13} | {'engine':<9} | {'total s':>8} | {'vs diffusers':>12} | {'max abs diff':>12} | {'PSNR dB':>7} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        diff = r.get("max_abs_diff_vs_diffusers")
        ps = r.get("psnr_db_vs_diffusers_exact")
        print(f"| {r['mode']:<13} | {r['engine']:<9} | {r['total_s']:>8.3f} | {t_ref / r['total_s']:>11.2f}x | "
              f"{'-' if diff is None else f'{diff:.1e}':>12} | {'-' if ps is None else ('inf' if ps == float('inf') else f'{ps:.1f}'):>7} |")
    result = {"preset": args.preset, "device": device, "threads": torch.get_num_threads(), "request": req,
              "torch": torch.__version__, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
