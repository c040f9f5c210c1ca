"""Long-row training memory and time: one packed row of ~2K-token documents per step, per row length,
for the dense-mask attention (`model.attn_implementation: sdpa`, a [rows, 1, S, S] document mask) and
the varlen path (`varlen`: per-document causal SDPA from the position ids; or a flash kernel on GPU).

    python bench/long_context.py                       # CPU: tiny Qwen3 (hidden 72, 3 layers), 4K-32K
    python bench/long_context.py --lengths 4096,65536  # any row lengths
    python bench/long_context.py --preset qwen3-0.6b   # GPU: Qwen3-0.6B's shape, 32K-128K, bf16

Each (variant, row length) runs in its own spawned process, through Spindle's causal-LM task: the rows
come from `spindle.data.text` (a JSONL of documents of `--doc-tokens` tokens each, EOS included, packed),
the step is the task's forward, backward, clip and optimizer step. Memory: the process's peak RSS on CPU
(VmHWM, everything the process ever held: interpreter, model, data, the step) and the step's part of it
(above what was in use before the first step); on CUDA torch.cuda.max_memory_allocated. Step time: the
median of the timed steps. A variant that does not fit is reported as failed (its error), not retried.
Prints a table, writes JSON (--out, default bench/results/long_context[-PRESET].json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402
from bench.train_llm import QWEN3_VOCAB, _memory_mark, _memory_peak  # noqa: E402
from spindle.testing.multiprocess import spawn  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # the measurement model: a tiny Qwen3 whose context is raised to 64K
    "cpu": dict(
        model=dict(
            hidden_size=72,
            intermediate_size=144,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=18,
            max_position_embeddings=65536,
        ),
        lengths=(4096, 8192, 16384, 32768),
        variants=("sdpa", "varlen"),
    ),
    "qwen3-0.6b": dict(
        model=dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=QWEN3_VOCAB,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rope_theta=1000000,
        ),
        lengths=(32768, 65536, 131072),
        variants=("sdpa", "varlen", "flash_attention_2"),
    ),
}


def write_documents(tokenizer_folder: Path, out: Path, count: int, doc_tokens: int) -> Path:
    """`count` {"text": ...} lines, each `doc_tokens` tokens long with its EOS (random words, trimmed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "north", "quiet"]
    lines = []
    for _ in range(count):
        text = " ".join(rng.choice(words) for _ in range(doc_tokens))
        ids = tok(text)["input_ids"][: doc_tokens - 1]  # the data pipeline appends the EOS
        text = tok.decode(ids)
        while len(tok(text)["input_ids"]) > doc_tokens - 1:  # decode/encode may merge differently
            text = text[:-1]
        lines.append(json.dumps({"text": text}))
    out.write_text("\n".join(lines) + "\n")
    return out


def _worker(rank: int, world: int, a: argparse.Namespace, variant: str, seq_len: int, folder: str, out: str) -> None:
    from spindle.api import job_family, job_task, load_job_config
    from spindle.data.text import build_text_dataset, collate_rows
    from spindle.distributed.fsdp import clip_grad_norm_
    from spindle.distributed.mesh import ParallelDims, build_mesh
    from spindle.train.optim import build_optimizer

    device = common.rank_device(rank)
    cuda = device.type == "cuda"
    data = write_documents(Path(folder), Path(out).with_suffix(".jsonl"), seq_len // a.doc_tokens, a.doc_tokens)
    overrides = {
        "model.path": folder,
        "model.attn_implementation": variant,
        "data.path": data,
        "data.seq_len": seq_len,
        "train.micro_batch_size": 1,
        "train.global_batch_size": 1,
        "train.lr": 1e-5,
        "train.mixed_precision": "auto",  # bf16 on CUDA, fp32 on CPU
    }
    result: dict = {"variant": variant, "seq_len": seq_len}
    try:
        cfg = load_job_config(None, [f"{k}={v}" for k, v in overrides.items()])
        family = job_family(cfg)
        task: Any = job_task(family)(
            cfg, family, build_mesh(ParallelDims(dp_shard=1)), device, "bf16" if cuda else "no"
        )
        model = task.build_model()
        optimizer = build_optimizer(model.parameters(), cfg.train)
        dataset = build_text_dataset(data, task.tokenizer, seq_len, True, False)
        batch = collate_rows([dataset[0]])
        result["documents_in_row"] = int((batch["position_ids"][0] == 0).sum())

        def step() -> None:
            out = task.forward(model, batch, 0)
            (out.loss_sum / task.loss_units(batch)).backward()
            clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        before = _memory_mark(device)
        times = []
        for i in range(a.warmup + a.steps):
            common.sync(device)
            t0 = time.perf_counter()
            step()
            common.sync(device)
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        peak = _memory_peak(device)
        result.update(step_s=statistics.median(times), peak_mem_mib=peak, step_mem_mib=peak - before, ok=True)
    except (RuntimeError, MemoryError, ValueError) as e:  # out of memory / a setting that cannot run: reported
        result.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    Path(out).write_text(json.dumps(result))


def run(a: argparse.Namespace, variant: str, seq_len: int, folder: Path) -> dict:
    threads = a.threads or max(1, os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d, "result.json")
        spawn(_worker, 1, a, variant, seq_len, str(folder), str(out), threads=threads)
        result: dict = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--lengths", default=None, help="comma-separated row lengths (default: the preset's)")
    p.add_argument("--variants", default=None, help="comma-separated model.attn_implementation values")
    p.add_argument("--doc-tokens", type=int, default=2048, help="tokens per document (EOS included)")
    p.add_argument("--steps", type=int, default=1, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", default=None, help="JSON results (default bench/results/long_context[-PRESET].json)")
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    lengths = [int(x) for x in a.lengths.split(",")] if a.lengths else list(preset["lengths"])
    variants = a.variants.split(",") if a.variants else list(preset["variants"])
    from spindle.models.qwen3.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny(Path(tmp) / "model", seed=0, transformer=preset["model"])
        results = []
        for seq_len in lengths:
            for variant in variants:
                r = run(a, variant, seq_len, folder)
                results.append(r)
                shown = f"peak {r['peak_mem_mib']:.0f} MiB, step {r['step_s']:.2f} s" if r["ok"] else r["error"]
                print(f"  {variant} S={seq_len}: {shown}", flush=True)
    report = dict(
        preset=a.preset,
        device=common.describe_device(),
        torch=torch.__version__,
        model=preset["model"],
        doc_tokens=a.doc_tokens,
        steps=a.steps,
        warmup=a.warmup,
        results=results,
    )
    common.print_table(
        [
            ("variant", "variant", "<18", ""),
            ("S", "seq_len", ">7", "d"),
            ("peak MiB", lambda r: r.get("peak_mem_mib", float("nan")), ">10", ".0f"),
            ("step MiB", lambda r: r.get("step_mem_mib", float("nan")), ">10", ".0f"),
            ("step s", lambda r: r.get("step_s", float("nan")), ">8", ".2f"),
        ],
        results,
    )
    name = "long_context.json" if a.preset == "cpu" else f"long_context-{a.preset}.json"
    common.write_report(report, Path(a.out or ROOT / "bench" / "results" / name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
