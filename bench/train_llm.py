"""LLM training-step benchmark: Spindle's causal-LM task vs the plain loop a user writes with
transformers + AdamW, on the same Qwen3-shaped model folder, token rows, seq_len and machine.

    python bench/train_llm.py                          # CPU preset: 4 layers, 152k vocab, 2 x 1024 tokens
    python bench/train_llm.py --preset qwen3-0.6b      # Qwen3-0.6B's shape on a GPU: MFU reported
    python bench/train_llm.py --preset qwen2.5-0.5b    # (and gemma3-1b) the newer dense families, a GPU

Variants (each run in its own spawned process(es), so memory is per variant: RSS on CPU,
torch.cuda.max_memory_allocated on CUDA; "peak" is the process's peak during the steps, "step" the part
of it above what was in use before the first step: activations, logits, gradients, optimizer state):
  transformers         `AutoModelForCausalLM` + `model(input_ids, labels=input_ids).loss` + clip + torch AdamW
                       (+ torch.autocast bf16 on CUDA): full [tokens, vocab] logits, transformers' loss
  spindle_full_logits  Spindle's causal-LM task (model build, loss sum / valid tokens, clip, optimizer) with the
                       stock transformers class: the same full-logits loss, inside Spindle
  spindle              Spindle's causal-LM task with the family's class (patchgen-generated: chunked linear
                       cross-entropy from the hidden states, never the full logits)
  spindle_sp2          `spindle` with parallel.sp=2 on 2 processes (Ulysses SP), when 2 devices exist
The rows are one document each (positions 0..seq_len-1), so every variant runs the same causal attention
and predicts the same seq_len-1 tokens per row. Runs are interleaved (variant A, B, C, A, B, C, ...) so
drifting machine load hits every variant alike; a run's step time is the median of its timed steps and a
variant's the median over its runs. Prints a table, writes JSON (--out, default bench/results/).
MFU (CUDA): 6 x matmul params (lm_head included, embedding lookup not) x tokens + 12 x layers x heads x
head_dim x seq_len x tokens (attention, the PaLM / torchtitan convention), over the GPU's bf16 dense peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

QWEN3_VOCAB = 151936
# name -> model config overrides + row shape. qwen3-0.6b: Qwen/Qwen3-0.6B's config.json shape.
PRESETS = {
    "cpu": dict(
        model=dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=QWEN3_VOCAB,
            tie_word_embeddings=True,
        ),
        seq_len=1024,
        batch=2,
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
            max_position_embeddings=40960,
            rope_theta=1000000,
        ),
        seq_len=4096,
        batch=2,
    ),
    # The dense families of the wave after Qwen3 at their published small checkpoints' shapes (config.json): a GPU
    # each. Gemma 3 runs sdpa (its sliding-window layers), the others the default attention.
    "qwen2.5-0.5b": dict(
        family="qwen2",
        model=dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
        seq_len=4096,
        batch=2,
    ),
    "gemma3-1b": dict(
        family="gemma3",
        model=dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            sliding_window=512,
            query_pre_attn_scalar=256,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
        seq_len=4096,
        batch=2,
    ),
}
VARIANTS = ("transformers", "spindle_full_logits", "spindle", "spindle_sp2")


def build_model_folder(a: argparse.Namespace, out: Path) -> Path:
    """A random model of the preset's family (Qwen3 unless it names one) and shape as a transformers folder
    (config, safetensors, tokenizer): the family's own tiny-model builder with the preset's config."""
    from spindle.contracts.family import import_object
    from spindle.registry import get_family

    preset = PRESETS[a.preset]
    build = import_object(get_family(str(preset.get("family", "qwen3"))).tiny_model)
    folder: Path = build(out, seed=0, transformer=preset["model"])
    return folder


def make_rows(a: argparse.Namespace, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (a.batch, a.seq_len), generator=g)


def spindle_batch(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows as Spindle's data pipeline emits them: global positions, pre-shifted labels."""
    rows, seq_len = ids.shape
    shift = torch.cat([ids[:, 1:], torch.full((rows, 1), -100)], dim=1)
    return {
        "input_ids": ids,
        "position_ids": torch.arange(seq_len).expand(rows, seq_len).clone(),
        "shift_labels": shift,
    }


def flops_per_step(a: argparse.Namespace, cfg: dict, n_params: int) -> float:
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    matmul_params = n_params if cfg["tie_word_embeddings"] else n_params - embed  # tied: lm_head counted once
    tokens = a.batch * a.seq_len
    attn = 12 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * a.seq_len
    return (6 * matmul_params + attn) * tokens


def _rss_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _memory_mark(device: torch.device) -> float:
    """Reset the peak counter; the memory in use now (model, inputs, before any step), MiB."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: reset the peak RSS (VmHWM) to the current RSS
    return _rss_mib("VmRSS")


def _memory_peak(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _rss_mib("VmHWM")


def _timed(a: argparse.Namespace, device: torch.device, step) -> dict:
    """Step times after warm-up; peak memory of the steps, absolute and above what was in use before them
    (the steps' own: activations, logits, gradients, optimizer state)."""
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
    return dict(step_times=times, peak_mem_mib=peak, step_mem_mib=peak - before)


def transformers_loop(a: argparse.Namespace, folder: Path, device: torch.device) -> tuple[int, dict, str]:
    """What a user writes: load, `model(input_ids, labels=...)`, backward, clip, AdamW."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = make_rows(a, model.config.vocab_size).to(device)
    cuda = device.type == "cuda"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    n_params = sum(p.numel() for p in model.parameters())
    return n_params, _timed(a, device, step), f"{type(model).__module__}.{type(model).__name__}"


def spindle_loop(
    a: argparse.Namespace, folder: Path, device: torch.device, sp: int, stock: bool
) -> tuple[int, dict, str]:
    """Spindle's causal-LM task: its model build (SP, FSDP2 when >1 process), loss sum over valid tokens,
    the trainer's normalisation, clip and optimizer; `stock`: the stock transformers class instead of the
    family's (full-logits loss)."""
    from spindle.api import load_job_config
    from spindle.distributed.fsdp import clip_grad_norm_
    from spindle.distributed.mesh import ParallelDims, build_mesh
    from spindle.train.optim import build_optimizer
    from spindle.train.tasks.causal_lm import CausalLMTask

    class StockClassTask(CausalLMTask):
        def load_model(self):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(
                self.cfg.model.path, dtype=torch.float32, attn_implementation="sdpa"
            )

    overrides = {
        "model.path": folder,
        "data.path": folder,  # unused: the bench feeds in-memory rows
        "data.seq_len": a.seq_len,
        "train.micro_batch_size": a.batch,
        "train.global_batch_size": a.batch,
        "train.lr": 1e-5,
        "parallel.sp": sp,
        "parallel.dp_shard": 1,
    }
    cfg = load_job_config(None, [f"{k}={v}" for k, v in overrides.items()])
    mesh = build_mesh(ParallelDims(dp_shard=1, sp=sp))
    precision = "bf16" if device.type == "cuda" else "no"
    task = (StockClassTask if stock else CausalLMTask)(cfg, mesh, device, precision)
    model = task.build_model()
    optimizer = build_optimizer(model.parameters(), cfg.train)
    batch = spindle_batch(make_rows(a, model.config.vocab_size))

    def step():
        units = task.loss_units(batch)
        out = task.forward(model, batch, 0)
        (out.loss_sum / units).backward()
        clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    from torch.distributed.fsdp import FSDPModule

    n_params = sum(p.numel() for p in model.parameters())  # an FSDP2 DTensor's numel is the full tensor's
    # FSDP2 swaps in a subclass (FSDP<Class>); report the model class itself
    cls = next(c for c in type(model).__mro__ if c.__name__.endswith("ForCausalLM") and not issubclass(c, FSDPModule))
    return n_params, _timed(a, device, step), f"{cls.__module__}.{cls.__name__}"


def _worker(rank: int, world: int, variant: str, a: argparse.Namespace, folder: str, out_dir: str) -> None:
    import torch.distributed as dist

    device = common.rank_device(rank)
    if variant == "transformers":
        n_params, timing, cls = transformers_loop(a, Path(folder), device)
    else:
        sp = 2 if variant == "spindle_sp2" else 1
        n_params, timing, cls = spindle_loop(a, Path(folder), device, sp, stock=variant == "spindle_full_logits")
    result = dict(n_params=n_params, model_class=cls, **timing)
    Path(out_dir, f"{variant}_rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized() and world > 1:
        dist.barrier()


def run_variant(variant: str, a: argparse.Namespace, folder: Path) -> dict:
    world = 2 if variant == "spindle_sp2" else 1
    cuda = torch.cuda.is_available()
    threads = a.threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, variant, a, str(folder), d, threads=threads, backend="nccl" if cuda else "gloo")
        ranks = [json.loads(Path(d, f"{variant}_rank{r}.json").read_text()) for r in range(world)]
    step_times = [max(ts) for ts in zip(*(r["step_times"] for r in ranks), strict=True)]  # the slowest rank
    return dict(
        processes=world,
        threads_per_process=threads,
        n_params=ranks[0]["n_params"],
        model_class=ranks[0]["model_class"],
        step_s=statistics.median(step_times),
        peak_mem_mib=max(r["peak_mem_mib"] for r in ranks),
        step_mem_mib=max(r["step_mem_mib"] for r in ranks),
        step_times=step_times,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per row (default: the preset's)")
    p.add_argument("--batch", type=int, default=None, help="rows per step (default: the preset's)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs per variant")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process (0: cores / processes)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--out", default=None, help="JSON results (default bench/results/train_llm[-PRESET].json)")
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    a.seq_len = a.seq_len or preset["seq_len"]
    a.batch = a.batch or preset["batch"]
    cuda = torch.cuda.is_available()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {VARIANTS}")
    if "spindle_sp2" in variants and cuda and torch.cuda.device_count() < 2:
        variants.remove("spindle_sp2")  # SP needs 2 devices on CUDA

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model_folder(a, Path(tmp) / "model")
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(a.repeats):
            for v in variants:
                runs[v].append(run_variant(v, a, folder))
                r = runs[v][-1]
                print(f"  run {v}: step {r['step_s']:.3f} s, step memory {r['step_mem_mib']:.0f} MiB", flush=True)

    cfg = PRESETS[a.preset]["model"]
    n_params = runs[variants[0]][0]["n_params"]
    tokens = a.batch * a.seq_len
    flops = flops_per_step(a, cfg, n_params)
    device_name = common.describe_device()
    peak = common.peak_flops(device_name, cuda)
    results = []
    for v in variants:
        step_s = statistics.median(r["step_s"] for r in runs[v])
        first = runs[v][0]
        results.append(
            dict(
                variant=v,
                processes=first["processes"],
                model_class=first["model_class"],
                step_s=step_s,
                tokens_per_s=tokens / step_s,
                peak_mem_mib=max(r["peak_mem_mib"] for r in runs[v]),
                step_mem_mib=max(r["step_mem_mib"] for r in runs[v]),
                tflops_per_s=flops / step_s / 1e12,
                mfu=(flops / step_s / first["processes"] / peak) if peak else None,
                run_step_s=[r["step_s"] for r in runs[v]],
            )
        )
    base = next((r for r in results if r["variant"] == "transformers"), results[0])
    for r in results:
        r["tokens_per_s_vs_transformers"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["step_mem_vs_transformers"] = r["step_mem_mib"] / base["step_mem_mib"]
    report = dict(
        preset=a.preset,
        device=device_name,
        torch=torch.__version__,
        precision="bf16 autocast" if cuda else "fp32",
        model=dict(cfg, n_params=n_params),
        batch=a.batch,
        seq_len=a.seq_len,
        steps=a.steps,
        warmup=a.warmup,
        repeats=a.repeats,
        flops_per_step=flops,
        results=results,
    )

    print(
        f"{device_name} | Qwen3-shaped {n_params / 1e6:.1f}M params, vocab {cfg['vocab_size']} | {a.batch} x "
        f"{a.seq_len} tokens | {report['precision']} | median of {a.repeats} interleaved runs x {a.steps} steps"
    )
    common.print_table(
        [
            *common.variant_columns(21),
            ("tokens/s", "tokens_per_s", ">10", ".0f"),
            ("vs tf", "tokens_per_s_vs_transformers", ">7", ".2f"),
            ("peak MiB", "peak_mem_mib", ">10", ".0f"),
            ("step MiB", "step_mem_mib", ">10", ".0f"),
            ("vs tf", "step_mem_vs_transformers", ">7", ".2f"),
            common.MFU_COLUMN,
        ],
        results,
    )
    name = "train_llm.json" if a.preset == "cpu" else f"train_llm-{a.preset}.json"
    out = Path(a.out or ROOT / "bench" / "results" / name)
    common.write_report(report, out)
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--family" in argv:  # MoE: other variants (ep, experts kernel), so its own script, bench/train_moe.py
        at = argv.index("--family")
        family, rest = argv[at + 1 : at + 2], argv[:at] + argv[at + 2 :]
        if family == ["qwen3_moe"]:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import train_moe

            sys.exit(train_moe.main(rest))
        if family != ["qwen3"]:
            sys.exit(f"--family: qwen3 (this script) or qwen3_moe (bench/train_moe.py), got {family}")
        argv = rest
    sys.exit(main(argv))
