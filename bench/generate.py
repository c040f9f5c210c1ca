"""Latency of Spindle's staged engine vs the checkpoint's diffusers pipeline (WanPipeline, FluxPipeline), side by side.

Same checkpoint, seed and parameters for every row. Modes:
  exact         Spindle `exact=True` (bit for bit the reference loop) vs diffusers
  default       Spindle's defaults (CFG batching, per-request prompt projections, oneDNN VAE convs and
                feed-forward Linear + GELU, freed host memory kept on CPU) vs diffusers
  kept_memory   Spindle's defaults vs diffusers in a process with the same allocator setting
                (`spindle.cpu_allocator.keep_freed_memory`): how much of `default` is not the allocator
  compile       regional torch.compile of the repeated blocks, both engines (warm-up not timed)
  cache         diffusers' first-block cache at each --thresholds value, both engines (PSNR vs exact)
  best          best vs best: Spindle default + compile + `cache="auto"` (calibrated at --min-psnr) vs
                diffusers + compile_repeated_blocks + the same cache hook and knobs (what a diffusers user
                who knows its speed options runs), both also against stock diffusers, interleaved
  sp2           Spindle, Ulysses sequence parallel over 2 processes (torchrun, gloo/nccl)
  cfg_parallel  Spindle, cond / uncond on 2 processes
  offload       (not in the default --modes) every transformer block streamed from host memory: Spindle's
                `blocks_to_swap` (spindle.infer.offload.ModuleOffload) vs diffusers' block-level group offloading
                (`diffusers.hooks.apply_group_offloading`, one block per group, a CUDA stream) on the same
                Spindle engine, timed interleaved, with their peak device memory and their difference from the
                engine without offload (a GPU measurement: on a CPU nothing is moved anywhere)

Every engine runs in its own process, as a user runs it (`EngineProcess`): process-wide settings one
engine makes (Spindle keeps freed host memory on CPU, `spindle.cpu_allocator`; compile caches) never
reach the other. Only one process works at a time; the parent interleaves their requests.

Checkpoints are random (no downloads here) but Wan-shaped: `--preset cpu` is small enough for a
CPU and sized so that the DiT, not the VAE, dominates (`--preset i2v-cpu`: the same for Wan2.1 I2V
against stock WanImageToVideoPipeline); `--preset wan1.3b` uses the Wan2.1-1.3B
transformer and VAE shapes (needs a GPU: 480x832, 81 frames); `--preset flux-cpu` / `flux-gpu` are
FLUX.1-shaped (true CFG with a negative prompt, so every mode applies); `--preset kontext-cpu` is
flux-cpu's shapes as FLUX.1 Kontext editing a source image (against stock FluxKontextPipeline);
`--preset qwenimage-cpu`, `qwenimage-edit-cpu` and `qwenimage-edit-plus-cpu` against stock
QwenImagePipeline, QwenImageEditPipeline and QwenImageEditPlusPipeline; `flux2-cpu` and `klein-cpu` against
Flux2Pipeline (no CFG: the CFG modes and the first-block cache do not apply) and Flux2KleinPipeline (CFG on
its empty negative prompt); `--preset z-image-cpu` against stock ZImagePipeline (VAE x8: 256x256 px -> 256 image
tokens); `hunyuan-video-1.5-cpu` / `hunyuan-video-1.5-i2v-cpu` against stock HunyuanVideo15Pipeline /
HunyuanVideo15ImageToVideoPipeline (64x64, 9 frames; no SP); `ltx2-cpu` against stock LTX2Pipeline (64x64, 9
frames, its default guidance). Prints a table and writes JSON.

  python bench/generate.py --preset cpu --json bench-generate.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402
from spindle.api import load_generator  # noqa: E402

PRESETS = {
    "cpu": dict(
        **common.WAN_SMALL,
        request=dict(height=128, width=128, num_frames=9, num_inference_steps=8, guidance_scale=5.0),
        dtype="float32",
    ),
    "wan1.3b": dict(  # Wan2.1-T2V-1.3B transformer + VAE shapes; a thin random text encoder of width 4096
        **common.WAN_1_3B,
        request=dict(height=480, width=832, num_frames=81, num_inference_steps=50, guidance_scale=5.0),
        dtype="bfloat16",
    ),
    # Wan2.1 I2V (family "wan_i2v"): the "cpu" preset's shapes with the I2V input (16 + 4 + 16 channels), a
    # CLIP image encoder, 512 text tokens (its transformer's fixed split) and a conditioning image
    "i2v-cpu": dict(
        family="wan_i2v",
        transformer={**common.WAN_SMALL["transformer"], "in_channels": 36},
        vae=common.WAN_SMALL["vae"],
        text_encoder=common.WAN_SMALL["text_encoder"],
        request=dict(height=128, width=128, num_frames=9, num_inference_steps=8, guidance_scale=5.0),
        image=(96, 160),  # the conditioning image's (height, width): the pipeline resizes it
        dtype="float32",
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
    # FLUX.1 Kontext (family "flux_kontext"): flux-cpu's shapes editing a source image kept at its own size
    # (auto_resize=False; ~1 megapixel otherwise) whose 576 tokens join the 576 of the 96x96 output
    "kontext-cpu": dict(
        family="flux_kontext",
        transformer=dict(
            num_layers=4,
            num_single_layers=8,
            num_attention_heads=8,
            attention_head_dim=32,
            axes_dims_rope=(8, 12, 12),
            in_channels=16,
        ),
        vae=dict(block_out_channels=(8, 16)),
        text_encoder_2=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        request=dict(
            height=96,
            width=96,
            max_area=96 * 96,
            auto_resize=False,
            num_inference_steps=6,
            guidance_scale=2.5,
            true_cfg_scale=4.0,
            max_sequence_length=64,
        ),
        image=(96, 96),
        dtype="float32",
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
    # Z-Image (family "z_image", stock ZImagePipeline): CFG at its default guidance 5 with the empty negative
    # prompt; no step caches (no CacheMixin) and no SP (no context-parallel plan): modes exact,default,compile
    "z-image-cpu": dict(
        family="z_image",
        transformer=dict(dim=256, n_heads=8, n_kv_heads=8, n_layers=6, axes_dims=[8, 12, 12]),
        text_encoder=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4),
        request=dict(height=256, width=256, num_inference_steps=6, guidance_scale=5.0, max_sequence_length=64),
        dtype="float32",
    ),
    # Qwen-Image-Edit (family "qwenimage_edit", stock QwenImageEditPipeline): Qwen-Image-cpu's DiT and text
    # encoder, the tiny edit VAE (x16) and vision tower; the input image sized by the pipeline to 1024x1024
    # pixels for the VAE (64x64 latents -> 1024 reference tokens next to the output's 60), true CFG
    "qwenimage-edit-cpu": dict(
        family="qwenimage_edit",
        transformer=dict(num_layers=6, num_attention_heads=8, attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
        text_encoder=dict(hidden_size=64, intermediate_size=128, num_attention_heads=4),
        image=(96, 160),
        request=dict(height=96, width=160, num_inference_steps=6, true_cfg_scale=4.0),
        dtype="float32",
    ),
    # FLUX.2-dev (family "flux2", stock Flux2Pipeline): guidance-distilled, so no CFG and no negative prompt (the
    # CFG modes do not apply); 96x96 px -> 48x48 latents -> 576 image tokens, the tiny Mistral3 text encoder
    "flux2-cpu": dict(
        family="flux2",
        transformer=dict(
            num_layers=4, num_single_layers=8, num_attention_heads=8, attention_head_dim=32, axes_dims_rope=(8, 8, 8, 8)
        ),
        request=dict(height=96, width=96, num_inference_steps=6, guidance_scale=4.0, max_sequence_length=64),
        no_negative_prompt=True,
        dtype="float32",
    ),
}
# FLUX.2 [klein] base (family "flux2_klein", stock Flux2KleinPipeline): the same DiT with CFG against its empty
# negative prompt (guidance 4); the tiny Qwen3 text encoder
PRESETS["klein-cpu"] = {
    **PRESETS["flux2-cpu"],
    "family": "flux2_klein",
    "transformer": {**PRESETS["flux2-cpu"]["transformer"], "guidance_embeds": False},
    "request": {**PRESETS["flux2-cpu"]["request"], "max_sequence_length": 32},
}
# HunyuanVideo-1.5 (families "hunyuan_video_1_5" / "hunyuan_video_1_5_i2v", stock HunyuanVideo15Pipeline /
# HunyuanVideo15ImageToVideoPipeline): CFG through the pipeline's guider at its 6.0, 64x64 px x 9 frames (VAE x16 x4:
# 48 video tokens next to the ~2000 text and image tokens the pipeline always sends); no SP (no context-parallel plan)
PRESETS["hunyuan-video-1.5-cpu"] = dict(
    family="hunyuan_video_1_5",
    transformer=dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, rope_axes_dim=(8, 12, 12)),
    request=dict(height=64, width=64, num_frames=9, num_inference_steps=6, guidance_scale=6.0),
    dtype="float32",
)
PRESETS["hunyuan-video-1.5-i2v-cpu"] = {
    **PRESETS["hunyuan-video-1.5-cpu"],
    "family": "hunyuan_video_1_5_i2v",
    "image": (64, 64),  # the stock pipeline sizes the video by the image: its 64x64 bucket
    "request": {k: v for k, v in PRESETS["hunyuan-video-1.5-cpu"]["request"].items() if k not in ("height", "width")},
}
# LTX-2 (family "ltx2", stock LTX2Pipeline): the pipeline's default guidance (CFG 3 / audio 7, STG, modality
# isolation, rescale: three transformer forwards a step), 64x64 px x 9 frames (tiny VAE x8 x2: 320 video tokens) with
# its audio track; no SP (the plan splits the video stream only)
PRESETS["ltx2-cpu"] = dict(
    family="ltx2",
    transformer=dict(num_layers=4, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64),
    request=dict(height=64, width=64, num_frames=9, num_inference_steps=6),
    dtype="float32",
)
# the several-image variant (stock QwenImageEditPlusPipeline): the same shapes, the image also seen at 384x384
PRESETS["qwenimage-edit-plus-cpu"] = {**PRESETS["qwenimage-edit-cpu"], "family": "qwenimage_edit_plus"}
COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2")  # per-preset overrides of the tiny builders
WARMUP_STEPS = 2  # one step is a NaN schedule for Qwen-Image's shift_terminal scheduler (a RequestError here)
PROMPT = dict(prompt="a red panda climbing a snowy tree, cinematic", negative_prompt="blurry, low quality")


def prompt(preset: dict) -> dict:
    """The prompts every row uses; a pipeline with no negative prompt (FLUX.2-dev, Klein) gets none."""
    return {"prompt": PROMPT["prompt"]} if preset.get("no_negative_prompt") else PROMPT


def preset_request(p: dict, args: argparse.Namespace) -> dict:
    """The preset's request with its prompts (+ --steps); an image-conditioned preset gets its seeded conditioning
    image."""
    req = {**prompt(p), **p["request"], **({"num_inference_steps": args.steps} if args.steps else {})}
    if "image" in p:  # the same image for both engines (and every process of the multi-process modes)
        from PIL import Image

        pixels = np.random.default_rng(args.seed).integers(0, 256, (*p["image"], 3), dtype=np.uint8)
        req["image"] = Image.fromarray(pixels)
    return req


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
    from spindle.infer.quality import psnr as _psnr

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

    from spindle.registry import resolve_family
    from spindle.testing.specs import declared

    index = json.loads((root / "model_index.json").read_text())
    vae = getattr(diffusers, index["vae"][1]).from_pretrained(root / "vae", dtype=vae_dtype)
    family = resolve_family(root)  # (a component stock cannot build here, e.g. Qwen-Image-Edit's processor)
    spec = declared(family)  # the family's conformance spec (its folder's conformance.py)
    overrides = spec.stock_overrides(root) if spec is not None and hasattr(spec, "stock_overrides") else {}
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(root, vae=vae, dtype=dtype, **overrides)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_names() -> dict[str, str]:
    """Spindle option -> the stock pipeline's keyword where they differ (FLUX.1 Kontext's `_auto_resize`)."""
    from spindle.registry import all_families
    from spindle.testing.specs import declared

    return {k: v for f in all_families() for k, v in (getattr(declared(f), "stock_names", None) or {}).items()}


def stock_guider() -> set[str]:
    """Spindle options a stock pipeline takes through its guider component (HunyuanVideo-1.5's guidance_scale)."""
    from spindle.registry import all_families
    from spindle.testing.specs import declared

    return {k for f in all_families() for k in (getattr(declared(f), "stock_guider", None) or ())}


def run_diffusers(pipe, req: dict, seed: int, steps: int | None = None) -> np.ndarray:
    names = stock_names()
    kw = {names.get(k, k): v for k, v in {**req, **({"num_inference_steps": steps} if steps else {})}.items()}
    if getattr(pipe, "guider", None) is not None:  # set on the pipeline's guider, not passed to __call__
        guided = {k: kw.pop(k) for k in stock_guider() if k in kw}
        pipe.guider = pipe.guider.new(**guided) if guided else pipe.guider
    if getattr(pipe.transformer, "is_cache_enabled", False):
        # diffusers' pipelines do not reset step-cache hooks per call (MagCache's step counter only wraps
        # at its configured step count): a fresh state per request, as Spindle's engine does
        pipe.transformer._reset_stateful_cache()
    out = pipe(**kw, generator=torch.Generator().manual_seed(seed), output_type="np")
    return out.frames if hasattr(out, "frames") else out.images  # video / image pipelines


def run_spindle(gen, req: dict, seed: int, steps: int | None = None):
    kw = {**req, **({"num_inference_steps": steps} if steps else {})}
    return gen.generate(**kw, seed=seed)


# ---------------------------------------------------------------- one engine per process


def _build_engine(kind: str, root: str, preset: str, options: dict, req: dict, seed: int) -> tuple[object, dict]:
    """In the engine's process: load it, apply its speed options, warm it up. -> (engine, setup info)."""
    p = PRESETS[preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = time.perf_counter()
    if kind == "diffusers":
        from spindle.infer.pipeline import DTYPES

        if options.get("keep_freed_memory"):
            from spindle.cpu_allocator import keep_freed_memory

            keep_freed_memory()
        pipe = diffusers_pipe(Path(root), DTYPES[p["dtype"]], device, DTYPES[p.get("vae_dtype", "float32")])
        if options.get("compile"):
            pipe.transformer.compile_repeated_blocks()
        if options.get("cache") is not None:
            from spindle.infer.caches import build_config

            name, threshold, knobs = options["cache"]
            pipe.transformer.enable_cache(build_config(name, threshold, knobs, lambda: pipe.current_timestep))
        run_diffusers(pipe, req, seed, steps=WARMUP_STEPS)  # warm-up (compilation with compile)
        return pipe, {"setup_s": round(time.perf_counter() - t, 2)}

    engine_options = {k: v for k, v in options.items() if k != "group_offload"}  # (the caller's stays whole)
    gen = load_generator(root, dtype=p["dtype"], vae_dtype=p.get("vae_dtype", "float32"), **engine_options)
    # diffusers' block-level group offloading on the engine's transformer (the `offload` mode)
    if options.get("group_offload"):
        from diffusers.hooks import apply_group_offloading

        gen.transformer.to("cpu")  # where diffusers expects the module to start (its offload device)
        apply_group_offloading(
            gen.transformer, device, "cpu", "block_level", num_blocks_per_group=1, use_stream=device == "cuda"
        )
        assert getattr(gen.transformer, "_diffusers_hook", None) is not None, "group offloading hooks not applied"
    info: dict = {}
    if options.get("cache") == "auto":
        run_spindle(gen, req, seed)  # calibration on this request (+ compilation)
        c = gen.cache_choice
        info["choice"] = dict(name=c.name, threshold=c.threshold, options=c.options, psnr=c.psnr, describe=c.describe())
    else:
        run_spindle(gen, req, seed, steps=WARMUP_STEPS)  # warm-up (compilation with compile)
    info["setup_s"] = round(time.perf_counter() - t, 2)
    return gen, info


def _engine_main(conn, kind: str, root: str, preset: str, options: dict, req: dict, seed: int, threads) -> None:
    """An engine process: build, report setup, then answer ("run", steps, out_path) until ("stop",)."""
    if threads:
        torch.set_num_threads(threads)
    try:
        engine, info = _build_engine(kind, root, preset, options, req, seed)
    except BaseException as e:  # report, so the parent fails with the reason instead of hanging
        conn.send(("error", f"{kind} {options}: {type(e).__name__}: {e}"))
        raise
    conn.send(("ready", info))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, steps, out_path = msg
        try:
            sync()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            if kind == "diffusers":
                frames, timings = run_diffusers(engine, req, seed, steps), {}
            else:
                res = run_spindle(engine, req, seed, steps)
                frames, timings = res.frames, dict(res.timings)
            sync()
            dt = time.perf_counter() - t
            timings["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if torch.cuda.is_available():
                timings["peak_device_mib"] = torch.cuda.max_memory_allocated() / 2**20
            np.save(out_path, frames)  # not timed; a file, since video outputs are large for a pipe
        except Exception as e:  # noqa: BLE001 - forwarded: the parent raises it with this message
            conn.send(("error", f"{kind} {options}: {type(e).__name__}: {e}", {}))
            continue
        conn.send(("done", dt, timings))


class EngineProcess:
    """One engine (`kind` "diffusers" or "spindle" with `options`) loaded in its own spawned process."""

    def __init__(self, kind: str, root: Path, args: argparse.Namespace, req: dict, options: dict, out_dir: Path):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.out = out_dir / f"{kind}-{os.getpid()}-{id(self)}.npy"
        self.proc = ctx.Process(
            target=_engine_main,
            args=(child, kind, str(root), args.preset, options, req, args.seed, args.threads),
            daemon=True,
        )
        self.proc.start()
        status, self.info = self._recv()
        if status != "ready":
            raise RuntimeError(self.info)

    def _recv(self):
        while not self.conn.poll(5):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self.proc.exitcode}")
        return self.conn.recv()

    def run(self, steps: int | None = None) -> tuple[float, np.ndarray, dict]:
        """One request, timed inside the engine's process: -> (seconds, frames, Spindle's stage timings)."""
        self.conn.send(("run", steps, str(self.out)))
        status, dt, timings = self._recv()
        if status != "done":
            raise RuntimeError(dt)
        return dt, np.load(self.out), timings

    def close(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(60)
        self.out.unlink(missing_ok=True)


# ---------------------------------------------------------------- multi-process worker


def worker(args: argparse.Namespace) -> None:
    """Runs under torchrun: one Spindle multi-process mode; rank 0 writes timings + frames."""
    import torch.distributed as dist

    p = PRESETS[args.preset]
    options = json.loads(args.worker_options)
    gen = load_generator(args.root, dtype=p["dtype"], vae_dtype=p.get("vae_dtype", "float32"), **options)
    req = preset_request(p, args)
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


def transformer_blocks(root: Path) -> int:
    """How many repeated blocks the checkpoint's transformer has (built on the meta device: no weights read)."""
    import diffusers

    from spindle.distributed.blocks import find_blocks

    config = json.loads((root / "transformer" / "config.json").read_text())
    with torch.device("meta"):
        model = getattr(diffusers, config["_class_name"]).from_config(config)
    return len(find_blocks(model))


def offload_rows(args: argparse.Namespace, root: Path, engine, close, add) -> None:
    """The `offload` mode: the engine without offload, with every block streamed by Spindle's `blocks_to_swap`
    and by diffusers' group offloading, requests interleaved; rows: time vs `blocks_to_swap`, peak device memory,
    the largest difference from the engine without offload (both stream the same values: 0 expected)."""
    blocks = transformer_blocks(root)
    plain = engine("spindle")
    swap = engine("spindle", blocks_to_swap=blocks)
    group = engine("spindle", group_offload=True)
    runs: dict[str, list] = {"plain": [], "swap": [], "group": []}
    for _ in range(args.repeats):
        for name, e in (("plain", plain), ("swap", swap), ("group", group)):
            runs[name].append(e.run())
    frames = {name: r[-1][1] for name, r in runs.items()}
    swap_s = statistics.median(t for t, _, _ in runs["swap"])
    for name, label in (("plain", "no offload"), ("swap", "blocks_to_swap"), ("group", "diffusers group offload")):
        total = statistics.median(t for t, _, _ in runs[name])
        peak = runs[name][-1][2].get("peak_device_mib")
        add(
            f"offload/{name}",
            "spindle",
            total,
            frames[name],
            swap_s,
            baseline_kind=f"Spindle blocks_to_swap={blocks}",
            offload=label,
            peak_device_mib=None if peak is None else round(peak, 1),
            max_abs_diff_vs_no_offload=float(np.abs(frames[name] - frames["plain"]).max()),
        )
    close(plain, swap, group)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu" if not torch.cuda.is_available() else "wan1.3b")
    ap.add_argument("--root", default=None, help="checkpoint folder (built if missing; default: a temp folder)")
    ap.add_argument("--modes", default="exact,default,kept_memory,compile,cache,best,sp2,cfg_parallel")
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

    modes = args.modes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    p = PRESETS[args.preset]
    req = preset_request(p, args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="spindle-bench-"))
    root = build_checkpoint(args.preset, Path(args.root) if args.root else tmp / "ckpt")
    rows: list[dict] = []
    engines: list[EngineProcess] = []

    def engine(kind: str, **options) -> EngineProcess:
        e = EngineProcess(kind, root, args, req, options, tmp)
        engines.append(e)
        return e

    def close(*es: EngineProcess) -> None:
        for e in es:
            e.close()
            engines.remove(e)

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

    def pair(mode: str, d_eng: EngineProcess, s_eng: EngineProcess, with_stock: bool = False, **extra) -> None:
        """Interleave diffusers and Spindle requests (ABAB...) so load changes on a shared machine hit both.
        `with_stock`: also interleave stock diffusers and report both engines against it."""
        d_times, s_times, k_times = [], [], []
        for _ in range(args.repeats):
            if with_stock:
                k_times.append(stock.run()[0])
            t, d_out, d_info = d_eng.run()
            d_times.append(t)
            t, s_out, timings = s_eng.run()
            s_times.append(t)
        d, s = statistics.median(d_times), statistics.median(s_times)
        stages = {k: round(v, 4) for k, v in timings.items() if k not in ("page_faults", "peak_device_mib")}
        # minor page faults of the last request in each process (fresh pages the kernel zero-fills)
        add(mode, "diffusers", d, d_out, d, page_faults=d_info["page_faults"])
        add(mode, "spindle", s, s_out, d, stages=stages, page_faults=timings["page_faults"], **extra)
        if with_stock:
            k = statistics.median(k_times)
            add(f"{mode}/stock", "diffusers", d, d_out, k, baseline_kind="stock diffusers")
            add(f"{mode}/stock", "spindle", s, s_out, k, baseline_kind="stock diffusers", stages=stages)

    print(
        f"preset {args.preset} on {device} ({torch.get_num_threads()} threads): {json.dumps(req, default=str)}",
        flush=True,
    )
    try:
        stock = engine("diffusers")
        ref = stock.run()[1]  # the exact reference output

        if "exact" in modes:
            e = engine("spindle", exact=True)
            pair("exact", stock, e)
            close(e)
        if "default" in modes:
            e = engine("spindle")
            pair("default", stock, e)
            close(e)
        if "kept_memory" in modes:
            d, e = engine("diffusers", keep_freed_memory=True), engine("spindle")
            pair("kept_memory", d, e)
            close(d, e)
        if "compile" in modes:
            d, e = engine("diffusers", compile=True), engine("spindle", compile=True)
            pair("compile", d, e, warmup_s=e.info["setup_s"], diffusers_warmup_s=d.info["setup_s"])
            close(d, e)
        if "best" in modes:
            e = engine("spindle", compile=True, cache="auto", min_psnr=args.min_psnr)
            choice = e.info["choice"]
            print(f"  best: {choice['describe']} (setup {e.info['setup_s']:.1f}s)", flush=True)
            cache = None
            if choice["name"] is not None:  # diffusers with the very hook and knobs Spindle chose
                # MagCache counts steps against its configured schedule (diffusers' default 28): this request's
                knobs = {
                    **choice["options"],
                    **({"num_inference_steps": req["num_inference_steps"]} if choice["name"] == "mag" else {}),
                }
                cache = (choice["name"], choice["threshold"], knobs)
            d = engine("diffusers", compile=True, cache=cache)
            pair(
                "best",
                d,
                e,
                with_stock=True,
                cache=choice["name"],
                cache_knob=choice["threshold"],
                calibration_psnr=choice["psnr"],
                setup_s=e.info["setup_s"],
            )
            close(d, e)
        if "cache" in modes:
            for thr in [float(x) for x in args.thresholds.split(",")]:
                d = engine("diffusers", cache=("fbc", thr, {}))
                e = engine("spindle", cache="fbc", cache_threshold=thr)
                pair(f"cache@{thr}", d, e)
                close(d, e)
        if "offload" in modes:
            offload_rows(args, root, engine, close, add)
        one_proc = None
        for mode, options in (("sp2", {"sp": 2}), ("cfg_parallel", {"cfg_parallel": True})):
            if mode in modes:
                if one_proc is None:
                    one_proc = engine("spindle", cfg_batch=True)
                info = run_multiprocess(args, root, options, mode, tmp)
                # right after the multi-process run, so both see the same machine load
                single = statistics.median(one_proc.run()[0] for _ in range(args.repeats))
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
    finally:
        for e in list(engines):
            close(e)

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
        "Spindle in 1 process, timed right after; offload: vs Spindle's blocks_to_swap, interleaved); max abs diff / "
        "PSNR: vs diffusers' exact output"
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
