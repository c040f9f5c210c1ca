"""MoE training-step benchmark: expert parallelism and the fused experts kernel, side by side (Qwen3-MoE, or the
family a preset names: DeepSeek-V3, GPT-OSS).

    python bench/train_moe.py                        # CPU preset (gloo, 1-2 processes)
    python bench/train_moe.py --preset qwen3-30b-a3b-layer --backend nccl   # one Qwen3-30B-A3B-shaped layer, GPUs
    python bench/train_moe.py --preset moonlight-16b-a3b-layer --backend nccl   # (and gpt-oss-20b-layer)
    python bench/train_llm.py --family qwen3_moe     # the same (train_llm.py hands MoE runs to this script)

Variants (Spindle's trainer and MoE task on a random folder of the preset's family and shape, each in its
own spawned process group, so peak memory is per variant: peak RSS of the largest process on CPU,
torch.cuda.max_memory_allocated on CUDA):
  ep1_fused     1 process, experts through transformers' fused kernel (grouped_mm; batched_mm on CPU when
                a weight row is not 16-byte aligned), the default
  ep1_loop      1 process, transformers' "eager" experts: a Python loop over the experts hit by the batch
  dp2_fused     2 processes, dp_shard=2, ep=1: every rank holds every expert (FSDP2-sharded)
  ep2_fused     2 processes, dp_shard=2, ep=2: each rank holds half the experts, tokens exchanged by all-to-all
Same global batch and rows everywhere; tokens/s = the global batch's tokens / median step time over the
timed steps (the first --warmup steps are not timed). Prints a table, writes JSON (--out).
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

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from spindle.testing.multiprocess import spawn  # noqa: E402

PRESETS = {
    "cpu": dict(
        model=dict(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_experts=16,
            num_experts_per_tok=2,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
        ),
        seq_len=256,
        global_batch=4,
        steps=6,
    ),
    # Qwen/Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts, top-8, expert FFN 768, 32 q / 4 kv heads of
    # 128), one decoder layer, on GPUs.
    "qwen3-30b-a3b-layer": dict(
        model=dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=1,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
        seq_len=4096,
        global_batch=4,
        steps=8,
    ),
    # The MoE families of the next wave, one decoder layer of each published shape (config.json), on GPUs:
    # Moonlight-16B-A3B's DeepSeek-V3 layer (MLA, 64 routed experts top-6 + 2 shared) and gpt-oss-20b's (32 fused
    # biased experts top-4, attention sinks: eager attention).
    "moonlight-16b-a3b-layer": dict(
        family="deepseek_v3",
        model=dict(
            hidden_size=2048,
            intermediate_size=11264,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            n_shared_experts=2,
            num_experts_per_tok=6,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            num_hidden_layers=1,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        seq_len=4096,
        global_batch=4,
        steps=8,
    ),
    "gpt-oss-20b-layer": dict(
        family="gpt_oss",
        model=dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            num_hidden_layers=1,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            layer_types=["full_attention"],
        ),
        seq_len=4096,
        global_batch=4,
        steps=8,
    ),
}
VARIANTS = {
    "ep1_fused": dict(nproc=1, ep=1, experts=None),
    "ep1_loop": dict(nproc=1, ep=1, experts="eager"),
    "dp2_fused": dict(nproc=2, ep=1, experts=None),
    "ep2_fused": dict(nproc=2, ep=2, experts=None),
}


def write_corpus(path: Path, rows: int, words: int) -> Path:
    import random

    rng = random.Random(0)
    vocab = "red green blue circle square moves left right up down the a on of gray background".split()
    lines = [json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) for _ in range(rows)]
    path.write_text("\n".join(lines) + "\n")
    return path


def worker(rank: int, world: int, model: str, data: str, out: str, preset: dict, variant: dict, result: str) -> None:
    from spindle.api import load_job_config, make_trainer

    overrides = {
        "model.path": model,
        "data.path": data,
        "data.seq_len": preset["seq_len"],
        "data.packing": True,
        "train.output_dir": out,
        "train.max_steps": preset["steps"],
        "train.global_batch_size": preset["global_batch"],
        "train.micro_batch_size": preset["global_batch"] // world,
        "checkpoint.resume": "none",
        "checkpoint.export": False,
        "parallel.dp_shard": world,
        "parallel.ep": variant["ep"],
    }
    trainer = make_trainer(load_job_config(None, [f"{k}={v}" for k, v in overrides.items()]))
    if variant["experts"]:
        trainer.model.config._experts_implementation = variant["experts"]  # read by every experts forward
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], 0
    for _ in range(preset["steps"]):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, _, _, tokens, _ = trainer.train_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    peaks = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    if rank == 0:
        Path(result).write_text(json.dumps({"step_times": times, "tokens": tokens, "peak_mib": max(peaks)}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every run")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "train_moe.json")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]

    from spindle.contracts.family import import_object
    from spindle.registry import get_family

    # the preset's family (Qwen3-MoE unless it names one), built by its own tiny-model builder at the preset's shape
    build_tiny_moe = import_object(get_family(str(preset.get("family", "qwen3_moe"))).tiny_model)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_moe(tmp / "model", seed=0, transformer=preset["model"])
        data = write_corpus(
            tmp / "data.jsonl", rows=preset["global_batch"] * preset["steps"] * 2, words=preset["seq_len"]
        )
        for name in args.variants:
            variant = VARIANTS[name]
            result = tmp / f"{name}.json"
            spawn(
                worker,
                variant["nproc"],
                str(model),
                str(data),
                str(tmp / name),
                preset,
                variant,
                str(result),
                threads=args.threads,
                backend=args.backend,
            )
            r = json.loads(result.read_text())
            step = statistics.median(r["step_times"][args.warmup :])
            rows.append(
                dict(
                    variant=name,
                    processes=variant["nproc"],
                    ep=variant["ep"],
                    experts=variant["experts"] or "fused",
                    step_s=step,
                    tokens_per_s=r["tokens"] / step,
                    peak_mib=r["peak_mib"],
                )
            )
            print(f"{name}: {rows[-1]['tokens_per_s']:.0f} tokens/s, peak {r['peak_mib']:.0f} MiB", flush=True)
    device = torch.cuda.get_device_name() if args.backend == "nccl" else f"CPU x{args.threads} thread(s)/process"
    print(f"\npreset {args.preset}, {device}")
    print(
        "| variant | processes | ep | experts | step (s) | tokens/s | peak MiB/process |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['variant']} | {r['processes']} | {r['ep']} | {r['experts']} | {r['step_s']:.3f} | "
            f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"preset": args.preset, "device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
