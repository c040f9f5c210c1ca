"""Sequence parallelism in a VLM's vision tower, per rank: forward + backward time and peak memory of a
Qwen2.5-VL-shaped vision tower (windowed blocks and full-attention blocks, random weights) on one batch of
images, with (spindle/distributed/vision_sequence_parallel.py):

  sp1           one process, the whole tower (no SP)
  sp2_gather    2 ranks; norms and MLPs on each rank's half of the patches, each block's attention
                all-gathers the sequence and runs its projections and kernel on every patch (the old path)
  sp2_ulysses   2 ranks; the attention's projections on the rank's half too, the kernel on half the heads
                over the whole sequence (all-to-all over the heads)

Each variant runs in fresh processes (gloo, one thread per rank, so a rank's time is its share of the work),
one warm-up step, then `--steps` timed ones; a step's time is the slowest rank's: wall seconds (median) and
the CPU seconds of the rank's process (gloo's threads included; the least over the steps), the figure to
compare on a loaded machine, where a rank descheduled while the other waits in a collective inflates the
wall time. Memory per rank: the bytes autograd holds for backward (saved activations, measured once with
saved-tensors hooks, deduplicated by storage; parameters excluded) and the peak RSS above the RSS before the
first forward (the high-water mark).
CPU only. Writes JSON (--out, default bench/results/vision_sp[-PRESET].json).

    python bench/vision_sp.py                     # 2 images of 448x448 (2048 patches), 8 blocks of width 384
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402

# Qwen2.5-VL's tower structure (14-pixel patches merged 2x2, 112-pixel windows, every 4th block full
# attention), scaled down to run in seconds on one core.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": dict(
        vision=dict(depth=8, hidden_size=384, intermediate_size=1024, num_heads=6, fullatt_block_indexes=[3, 7]),
        images=[(448, 448), (448, 448)],
    ),
}
VARIANTS = {"sp1": (1, None), "sp2_gather": (2, "gather"), "sp2_ulysses": (2, "ulysses")}


def build_tower(preset: str) -> tuple[Any, Any, Any]:
    """A seeded random Qwen2.5-VL vision tower (sdpa, fp32) and its inputs: patch rows and grid_thw."""
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    p = PRESETS[preset]
    vision = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=512)
    config = Qwen2_5_VLConfig(vision_config={**vision, **p["vision"]}).vision_config
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config)
    grid = torch.tensor([[1, h // 14, w // 14] for h, w in p["images"]])
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(0))
    return tower, pixels, grid


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def saved_bytes(step, params: set[int]) -> int:
    """Bytes autograd saves for backward during `step()` (distinct storages, parameters excluded)."""
    import torch

    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def _worker(rank: int, world: int, preset: str, attention: str | None, steps: int, out: str) -> None:
    import torch.distributed as dist

    from spindle.distributed.vision_sequence_parallel import enable_vision_sequence_parallel

    tower, pixels, grid = build_tower(preset)
    if attention:
        enable_vision_sequence_parallel(tower, dist.group.WORLD, rank, world, attention=attention)

    def step() -> None:
        out = tower(pixels, grid_thw=grid).pooler_output
        out.square().mean().backward()
        tower.zero_grad(set_to_none=True)

    params = {p.untyped_storage().data_ptr() for p in tower.parameters()}
    rss_before = rss_kib()
    saved = saved_bytes(step, params)  # the warm-up step
    times, cpu = [], []
    for _ in range(steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    result = dict(times=times, cpu=cpu, saved_mib=saved / 2**20, peak_rss_mib=peak / 1024, patches=int(pixels.shape[0]))
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run_variant(preset: str, variant: str, steps: int) -> dict[str, Any]:
    from spindle.testing.multiprocess import spawn

    world, attention = VARIANTS[variant]
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_worker, world, preset, attention, steps, tmp)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    step_s = statistics.median(max(times) for times in zip(*(r["times"] for r in ranks), strict=True))
    return dict(
        variant=variant,
        processes=world,
        patches=ranks[0]["patches"],
        step_s=step_s,
        cpu_s=min(max(cpu) for cpu in zip(*(r["cpu"] for r in ranks), strict=True)),
        saved_mib=max(r["saved_mib"] for r in ranks),
        peak_rss_mib=max(r["peak_rss_mib"] for r in ranks),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--steps", type=int, default=5, help="timed forward+backward steps after one warm-up step")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = [run_variant(a.preset, v, a.steps) for v in a.variants]
    for row in rows:
        row["cpu_vs_first"] = rows[0]["cpu_s"] / row["cpu_s"]
    columns: list[common.Column] = [
        *common.variant_columns(13),
        ("patches", "patches", ">8", ""),
        ("CPU s/rank", "cpu_s", ">11", ".3f"),
        ("CPU vs first", "cpu_vs_first", ">13", ".2f"),
        ("saved MiB/rank", "saved_mib", ">15", ".0f"),
        ("peak RSS MiB/rank", "peak_rss_mib", ">18", ".0f"),
    ]
    common.print_table(columns, rows)
    name = "vision_sp.json" if a.preset == "cpu" else f"vision_sp-{a.preset}.json"
    report = dict(preset=a.preset, config=PRESETS[a.preset], device=common.describe_device(), steps=a.steps, rows=rows)
    common.write_report(report, a.out or ROOT / "bench" / "results" / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
