"""Training-step benchmark: Spindle (FSDP2 / Ulysses SP through spindle.distributed) vs a plain
PyTorch + diffusers loop, on the same transformer, batch, precision and in-memory data.
`--family wan` (default): a Wan-shaped `WanTransformer3DModel`; `--family flux`: a FLUX.1-shaped
`FluxTransformer2DModel` (layers/2 double-stream + layers single-stream blocks, packed 2x2 latents,
pooled text, embedded guidance); SP then goes through Flux's `_cp_plan`.

    python bench/train.py                      # CPU defaults: ~34M params, 1024 tokens, a few steps
    python bench/train.py --family flux        # the same sizes, Flux-shaped
    python bench/train.py --layers 12 --steps 20 --frames 8 --height 64 --width 64   # on a GPU

Each variant runs in its own spawned process(es), so peak memory (RSS on CPU,
torch.cuda.max_memory_allocated on CUDA) is per variant:
  baseline          plain `WanTransformer3DModel` + AdamW (+ torch.autocast bf16 on CUDA), 1 process
  baseline_compile  the same + diffusers' `compile_repeated_blocks()` (what a diffusers user can turn on), 1 process
  spindle           `parallelize_transformer` on the 1-process mesh (no sharding to do: autocast bf16 on CUDA),
                    Spindle's optimizer (fused AdamW where the device has it), device-side clipping and, on
                    CPU, freed host memory kept in the process (`spindle.cpu_allocator`), 1 process
  spindle_compile   the same with `compile=True` (train.compile: regional compile of each block), 1 process
  spindle_sp2       `spindle` with parallel.sp=2 on 2 processes (both ranks get the same batch), when 2 devices exist
`--rounds R` runs the 1-process variants R times, interleaved (A B C D, A B C D, ...), so load on a
shared machine hits all of them; step times are medians over all rounds' steps.
Prints a table and writes JSON (--out). MFU is reported on CUDA only (bf16 dense peak of the GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402
from spindle.testing.multiprocess import spawn  # noqa: E402


def model_config(a: argparse.Namespace) -> dict:
    return FAMILIES[a.family]["config"](a)


def wan_config(a: argparse.Namespace) -> dict:
    return dict(
        patch_size=(1, 2, 2),
        num_attention_heads=a.heads,
        attention_head_dim=a.head_dim,
        in_channels=16,
        out_channels=16,
        text_dim=a.text_dim,
        freq_dim=256,
        ffn_dim=a.ffn_dim,
        num_layers=a.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    )


def flux_config(a: argparse.Namespace) -> dict:
    side = (a.head_dim * 3 // 8) // 2 * 2  # rope axes (t, h, w) summing to the head dim, as Flux's (16, 56, 56)
    return dict(
        patch_size=1,
        in_channels=64,
        num_layers=max(1, a.layers // 2),
        num_single_layers=a.layers,
        attention_head_dim=a.head_dim,
        num_attention_heads=a.heads,
        joint_attention_dim=a.text_dim,
        pooled_projection_dim=a.text_dim,
        guidance_embeds=True,
        axes_dims_rope=(a.head_dim - 2 * side, side, side),
    )


def tokens_per_sample(a: argparse.Namespace) -> int:
    """Tokens after the 2x2 patches: Wan frames x h/2 x w/2; Flux (images: --frames unused) h/2 x w/2."""
    return FAMILIES[a.family]["frames"](a) * (a.height // 2) * (a.width // 2)


def attention_layers(a: argparse.Namespace) -> int:
    cfg = model_config(a)
    return cfg["num_layers"] + cfg.get("num_single_layers", 0)


def make_data(a: argparse.Namespace, device: torch.device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in FAMILIES[a.family]["data"](a).items()}


def flux_data(a: argparse.Namespace) -> dict:
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(0)
    b, h, w = a.batch, a.height // 2, a.width // 2
    return {
        "hidden_states": torch.randn(b, h * w, 64, generator=g),
        "timestep": torch.rand(b, generator=g),
        "guidance": torch.full((b,), 3.5),
        "pooled_projections": torch.randn(b, a.text_dim, generator=g),
        "encoder_hidden_states": torch.randn(b, a.text_len, a.text_dim, generator=g),
        "txt_ids": torch.zeros(a.text_len, 3),
        "img_ids": FluxPipeline._prepare_latent_image_ids(b, h, w, "cpu", torch.float32),
        "target": torch.randn(b, h * w, 64, generator=g),
    }


def wan_data(a: argparse.Namespace) -> dict:
    g = torch.Generator().manual_seed(0)
    b = a.batch
    data = {
        "hidden_states": torch.randn(b, 16, a.frames, a.height, a.width, generator=g),
        "timestep": torch.rand(b, generator=g) * 1000,
        "encoder_hidden_states": torch.randn(b, a.text_len, a.text_dim, generator=g),
        "target": torch.randn(b, 16, a.frames, a.height, a.width, generator=g),
    }
    return data


# family -> (transformer class, its config, in-memory batch: the transformer's forward kwargs + "target")
FAMILIES = {
    "wan": dict(
        cls="WanTransformer3DModel", config=wan_config, data=wan_data, frames=lambda a: a.frames, out="train.json"
    ),
    "flux": dict(
        cls="FluxTransformer2DModel", config=flux_config, data=flux_data, frames=lambda a: 1, out="train-flux.json"
    ),
}


def build_model(a: argparse.Namespace, device: torch.device):
    import diffusers

    torch.manual_seed(0)
    model = getattr(diffusers, FAMILIES[a.family]["cls"])(**model_config(a)).to(device)
    model.train()
    return model


def flops_per_step(a: argparse.Namespace, n_params: int) -> float:
    """6 * params * tokens (dense fwd+bwd) + self-attention 12 * layers * T^2 * dim, per sample."""
    t = tokens_per_sample(a)
    dim = a.heads * a.head_dim
    layers = attention_layers(a)
    per_sample = 6 * n_params * t + 12 * layers * t * t * dim + 12 * layers * t * a.text_len * dim
    return per_sample * a.batch


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB


def _loop(a, model, data, optimizer, device, clip, autocast: bool, warmup: int) -> tuple[list[float], list[int]]:
    """-> (seconds, minor page faults) of each timed step."""
    times, faults = [], []
    for i in range(warmup + a.steps):
        common.sync(device)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(**{k: v for k, v in data.items() if k != "target"}, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), data["target"])
        loss.backward()
        norm = clip(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss.detach()), float(norm)  # both loops log these two scalars
        common.sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return times, faults


def _worker(rank: int, world: int, variant: str, a: argparse.Namespace, out_dir: str) -> None:
    import torch.distributed as dist

    device = common.rank_device(rank)
    cuda = device.type == "cuda"
    model = build_model(a, device)
    n_params = sum(p.numel() for p in model.parameters())
    data = make_data(a, device)
    compile = variant.endswith("_compile")
    warmup = a.warmup + (1 if compile else 0)  # the first step compiles forward and backward
    if variant.startswith("baseline"):
        if compile:
            model.compile_repeated_blocks()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        times, faults = _loop(
            a, model, data, optimizer, device, torch.nn.utils.clip_grad_norm_, autocast=cuda, warmup=warmup
        )
    else:
        from spindle.config import TrainConfig
        from spindle.cpu_allocator import bound_freed_memory
        from spindle.distributed.fsdp import autocast_dtype, clip_grad_norm_tensor_
        from spindle.distributed.mesh import ParallelDims, build_mesh
        from spindle.distributed.parallelize import parallelize_transformer
        from spindle.train.optim import build_optimizer

        if not cuda:
            bound_freed_memory()  # as Spindle's Trainer does on CPU by default (train.keep_freed_memory: false)
        sp = 2 if variant == "spindle_sp2" else 1
        mesh = build_mesh(ParallelDims(sp=sp))
        precision = "bf16" if cuda else "no"
        parallelize_transformer(model, mesh, mixed_precision=precision, gradient_checkpointing=False, compile=compile)
        optimizer = build_optimizer(model.parameters(), TrainConfig(lr=1e-5))
        autocast = autocast_dtype(model, precision) is not None  # 1 process: no FSDP policy to cast
        times, faults = _loop(
            a, model, data, optimizer, device, clip_grad_norm_tensor_, autocast=autocast, warmup=warmup
        )
    result = dict(
        rank=rank,
        world=world,
        n_params=n_params,
        step_times=times,
        page_faults=faults,
        peak_mem_mib=_peak_memory(device),
    )
    Path(out_dir, f"{variant}_rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized() and world > 1:
        dist.barrier()


def run_variant(variant: str, world: int, a: argparse.Namespace) -> list[float]:
    """One run of `variant`: -> its step times (a step ends when the slowest rank ends)."""
    with tempfile.TemporaryDirectory() as d:
        cuda = torch.cuda.is_available()
        threads = a.threads if a.threads else max(1, (os.cpu_count() or 1) // world)
        spawn(_worker, world, variant, a, d, threads=threads, backend="nccl" if cuda else "gloo")
        ranks = [json.loads(Path(d, f"{variant}_rank{r}.json").read_text()) for r in range(world)]
    a._n_params, a._peak = ranks[0]["n_params"], max(r["peak_mem_mib"] for r in ranks)
    a._faults = ranks[0]["page_faults"]  # rank 0's minor page faults per timed step
    return [max(ts) for ts in zip(*(r["step_times"] for r in ranks), strict=True)]


def summarize(
    variant: str, world: int, step_times: list[float], faults: list[int], peak: float, a: argparse.Namespace
) -> dict:
    import statistics

    threads = a.threads if a.threads else max(1, (os.cpu_count() or 1) // world)
    mean = statistics.median(step_times)
    return dict(
        variant=variant,
        processes=world,
        threads_per_process=threads,
        n_params=a._n_params,
        step_s=mean,
        samples_per_s=a.batch / mean,
        tokens_per_s=a.batch * tokens_per_sample(a) / mean,
        peak_mem_mib=peak,
        page_faults_per_step=statistics.median(faults),  # fresh pages the kernel zero-fills (CPU: see cpu_allocator)
        step_times=step_times,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="wan", help="transformer shape (default wan)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ffn-dim", type=int, default=2048)
    p.add_argument("--text-dim", type=int, default=512)
    p.add_argument("--text-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--height", type=int, default=32)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    # untimed steps first: compilation, and on CPU the first steps of a process also grow the malloc
    # heap (page faults a long run does not pay), so fewer than 3 measures a start-up transient
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument("--no-sp", action="store_true", help="skip the 2-process SP run")
    p.add_argument("--no-compile", action="store_true", help="skip the compiled variants")
    p.add_argument("--rounds", type=int, default=1, help="interleaved runs of the 1-process variants")
    p.add_argument("--out", default=None, help="JSON results (default bench/results/train.json, train-flux.json)")
    a = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    variants = ["baseline", "spindle"] + ([] if a.no_compile else ["baseline_compile", "spindle_compile"])
    times: dict[str, list[float]] = {v: [] for v in variants}
    faults: dict[str, list[int]] = {v: [] for v in variants}
    peaks: dict[str, float] = {}
    for _ in range(a.rounds):
        for v in variants:
            times[v] += run_variant(v, 1, a)
            faults[v] += a._faults
            print(f"  {v}: step times {[round(t, 3) for t in times[v]]}", flush=True)  # partial results
            peaks[v] = max(peaks.get(v, 0.0), a._peak)
    results = [summarize(v, 1, times[v], faults[v], peaks[v], a) for v in variants]
    if not a.no_sp and (not cuda or torch.cuda.device_count() >= 2):
        sp_times = run_variant("spindle_sp2", 2, a)
        results.append(summarize("spindle_sp2", 2, sp_times, a._faults, a._peak, a))

    base = results[0]
    n_params = base["n_params"]
    device_name = common.describe_device()
    peak = common.peak_flops(device_name, cuda)
    flops = flops_per_step(a, n_params)
    for r in results:
        r["tokens_per_s_vs_baseline"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["tflops_per_s"] = flops / r["step_s"] / 1e12
        # MFU per device: an SP group shares one batch over `processes` devices.
        r["mfu"] = (flops / r["step_s"] / r["processes"] / peak) if peak else None
    report = dict(
        family=a.family,
        device=device_name,
        torch=torch.__version__,
        precision="bf16" if cuda else "fp32",
        model=dict(model_config(a), n_params=n_params),
        batch=a.batch,
        tokens_per_sample=tokens_per_sample(a),
        steps=a.steps,
        warmup=a.warmup,
        flops_per_step=flops,
        results=results,
    )
    by = {r["variant"]: r for r in results}
    if "spindle_sp2" in by:
        report["sp2_speedup_vs_spindle_1proc"] = by["spindle_sp2"]["tokens_per_s"] / by["spindle"]["tokens_per_s"]
    if "spindle_compile" in by:  # best vs best: Spindle's compiled step vs diffusers' compile_repeated_blocks
        report["best_vs_best"] = by["spindle_compile"]["tokens_per_s"] / by["baseline_compile"]["tokens_per_s"]
        report["best_vs_plain_loop"] = by["spindle_compile"]["tokens_per_s"] / by["baseline"]["tokens_per_s"]

    print(
        f"{device_name} | {n_params / 1e6:.1f}M params | {a.batch} x {tokens_per_sample(a)} tokens | "
        f"{report['precision']} | {a.steps} steps after {a.warmup} warm-up"
    )
    common.print_table(
        [
            *common.variant_columns(17),
            ("samples/s", "samples_per_s", ">11", ".3f"),
            ("tokens/s", "tokens_per_s", ">10", ".0f"),
            ("vs base", "tokens_per_s_vs_baseline", ">9", ".2f"),
            ("peak MiB", "peak_mem_mib", ">10", ".0f"),
            ("faults/step", "page_faults_per_step", ">12", ".0f"),
            common.MFU_COLUMN,
        ],
        results,
    )
    out = Path(a.out or ROOT / "bench" / "results" / FAMILIES[a.family]["out"])
    common.write_report(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
