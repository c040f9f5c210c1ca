"""Post-training benchmark: Spindle's DPO step against `trl.DPOTrainer`, and where a Spindle GRPO step's time goes.

    python bench/post_training.py                   # CPU preset: a small Qwen3 (4 layers, 152k vocab)
    python bench/post_training.py --preset qwen3-0.6b   # Qwen3-0.6B's shape (a GPU)

DPO variants, each a real training run of `--warmup + --steps` optimizer steps in its own process (memory is per
variant: peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA, "step" the part of the peak above what was in
use once the trainer was set up: activations, logits, gradients, optimizer state, the reference's forward):
  spindle_ref    `spindle train` with train.objective dpo, a full fine-tune: the reference a frozen copy of the
                 starting weights (sharded like the policy)
  trl_ref        `trl.DPOTrainer` full fine-tune: its reference a copy of the model (ref_model=None)
  spindle_lora   LoRA r16 on every projection: the reference is the policy with its adapters switched off
  trl_lora       `DPOTrainer` with the same PEFT LoRA config: TRL's adapters-disabled reference
  spindle_pre    full fine-tune with `dpo.precompute_reference`: the reference's log-probabilities computed once
                 before the first step (from the policy as loaded: no frozen copy at all), none during training
  trl_pre        `DPOTrainer` with precompute_ref_log_probs=True (its reference copy computes them up front)
Same model folder, preference lines, batch (all pairs of a step in one micro-batch), seq_len, learning rate,
beta, AdamW and precision (fp32 on CPU, bf16 autocast on CUDA). A variant's step time is the median of its timed
steps (Spindle: the trainer's `step_time_s`; TRL: a callback's step begin -> end).

GRPO: one Spindle run (`train.objective: grpo`, 4 prompts x 8 completions of `--new-tokens` tokens a step, the
share-of-"a" reward of `spindle demo --objective grpo`): the median generated tokens/s and the step split into
generation / scoring / update (the objective's `time/generation_s`, `time/scoring_s`; update = the step time minus
both: the policy's forward and backward on the rollouts and the optimizer step).

Prints a table, writes JSON (--out, default bench/results/post_training.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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

QWEN3_VOCAB = 151936
PRESETS: dict[str, dict[str, Any]] = {
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
        pairs=4,
        words=(24, 48),  # words per prompt, per completion
        seq_len=256,
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
        pairs=8,
        words=(200, 400),
        seq_len=1024,
    ),
}
DPO_VARIANTS = ("spindle_ref", "trl_ref", "spindle_lora", "trl_lora", "spindle_pre", "trl_pre")
LORA_RANK = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # Spindle's default
LR, BETA = 1e-5, 0.1
WORDS = "the a red blue cat dog sky river stone light quick slow over under and then runs sleeps".split()
GRPO_REWARD = 'def letter_a(completions, **columns):\n    return [c.count("a") / max(len(c), 1) for c in completions]\n'


def write_pairs(path: Path, n: int, words: tuple[int, int]) -> Path:
    g = torch.Generator().manual_seed(0)

    def text(k: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist())

    lines = [
        {"prompt": text(words[0]), "chosen": " " + text(words[1]), "rejected": " " + text(words[1])} for _ in range(n)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def memory_mark(device: torch.device) -> float:
    """Reset the peak counter; -> the memory in use now, MiB."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux: the peak RSS (VmHWM) back to the current RSS
    return _rss_mib("VmRSS")


def memory_peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else _rss_mib("VmHWM")


# ---------------------------------------------------------------- variants (each in its own process)


def spindle_overrides(a: argparse.Namespace, out: Path, **values: Any) -> list[str]:
    base = {
        "model.path": a.folder,
        "data.path": a.data,
        "data.seq_len": a.seq_len,
        "data.shuffle": False,
        "train.output_dir": out,
        "train.max_steps": a.warmup + a.steps,
        "train.global_batch_size": a.pairs,
        "train.micro_batch_size": a.pairs,
        "train.lr": LR,
        "train.warmup_steps": 0,
        "checkpoint.every_steps": 10_000,
        "checkpoint.export": False,
        "checkpoint.resume": "none",
    }
    return [f"{k}={v}" for k, v in {**base, **values}.items()]


def run_spindle(a: argparse.Namespace, device: torch.device, overrides: list[str]) -> dict[str, Any]:
    from spindle.api import load_job_config, make_trainer
    from spindle.train.metrics import read_metrics

    trainer = make_trainer(load_job_config(None, overrides))
    before = memory_mark(device)
    trainer.run()
    peak = memory_peak(device)
    metrics = read_metrics(trainer.cfg.train.output_dir)
    return dict(
        metrics=metrics[a.warmup :], first_loss=metrics[0]["loss"], peak_mem_mib=peak, step_mem_mib=peak - before
    )


def spindle_dpo(a: argparse.Namespace, device: torch.device, lora: bool, precompute: bool) -> dict[str, Any]:
    extra: dict[str, Any] = {"train.objective": "dpo", "dpo.beta": BETA}
    if lora:
        extra["train.lora.rank"] = LORA_RANK
    if precompute:
        extra["dpo.precompute_reference"] = True
    with tempfile.TemporaryDirectory() as tmp:
        run = run_spindle(a, device, spindle_overrides(a, Path(tmp), **extra))
    times = [m["step_time_s"] for m in run.pop("metrics")]
    return dict(run, step_times=times)


class StepTimes:
    """A transformers TrainerCallback's hooks: each optimizer step's wall time (begin -> end)."""

    def __init__(self, device: torch.device) -> None:
        from transformers import TrainerCallback

        outer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                common.sync(device)
                outer.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                common.sync(device)
                outer.times.append(time.perf_counter() - outer.start)

        self.start = 0.0
        self.times: list[float] = []
        self.callback = Callback()


def trl_dpo(a: argparse.Namespace, device: torch.device, lora: bool, precompute: bool) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = device.type == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(a.folder)
    model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.float32, attn_implementation="sdpa")
    lines = [json.loads(line) for line in Path(a.data).read_text().splitlines()]
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, target_modules=LORA_TARGETS, lora_dropout=0.0)
    timer = StepTimes(device)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp,
            report_to=[],
            bf16=cuda,
            use_cpu=not cuda,
            per_device_train_batch_size=a.pairs,
            gradient_accumulation_steps=1,
            max_steps=a.warmup + a.steps,
            learning_rate=LR,
            lr_scheduler_type="constant",
            beta=BETA,
            precompute_ref_log_probs=precompute,
            max_length=a.seq_len,
            save_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
        )
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(lines),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[timer.callback],
        )
        before = memory_mark(device)
        trainer.train()
        peak = memory_peak(device)
    first_loss = next(log["loss"] for log in trainer.state.log_history if "loss" in log)
    return dict(
        step_times=timer.times[a.warmup :], first_loss=first_loss, peak_mem_mib=peak, step_mem_mib=peak - before
    )


def spindle_grpo(a: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        rewards = Path(tmp) / "rewards.py"
        rewards.write_text(GRPO_REWARD)
        prompts = Path(tmp) / "prompts.jsonl"
        lines = [json.loads(line) for line in Path(a.data).read_text().splitlines()]
        prompts.write_text("".join(json.dumps({"prompt": line["prompt"]}) + "\n" for line in lines))
        extra = {
            "data.path": prompts,
            "train.objective": "grpo",
            "train.lr": 1e-3,
            "grpo.num_generations": 8,
            "grpo.max_new_tokens": a.new_tokens,
            "grpo.rewards": f"[{rewards}:letter_a]",
        }
        run = run_spindle(a, device, spindle_overrides(a, Path(tmp) / "run", **extra))
    metrics = run.pop("metrics")
    med = {k: statistics.median(m[k] for m in metrics) for k in ("step_time_s", "time/generation_s", "time/scoring_s")}
    return dict(
        run,
        prompts_per_step=a.pairs,
        completions_per_step=8 * a.pairs,
        completion_length=statistics.median(m["completion_length"] for m in metrics),
        generated_tokens_per_s=statistics.median(m["generated_tokens_per_s"] for m in metrics),
        step_s=med["step_time_s"],
        generation_s=med["time/generation_s"],
        scoring_s=med["time/scoring_s"],
        update_s=med["step_time_s"] - med["time/generation_s"] - med["time/scoring_s"],
    )


def run_variant(a: argparse.Namespace) -> dict[str, Any]:
    device = common.rank_device(0)
    if a.variant == "grpo":
        return spindle_grpo(a, device)
    lora, precompute = a.variant.endswith("_lora"), a.variant.endswith("_pre")
    return (spindle_dpo if a.variant.startswith("spindle") else trl_dpo)(a, device, lora, precompute)


def in_process(a: argparse.Namespace, variant: str, result: Path) -> dict[str, Any]:
    """One variant in a fresh process (its own memory peak); -> its result."""
    cmd = [sys.executable, __file__, "--variant", variant, "--result", str(result)]
    for key in ("folder", "data", "seq_len", "pairs", "warmup", "steps", "new_tokens"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"variant {variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (after --warmup)")
    p.add_argument("--new-tokens", type=int, default=32, help="GRPO: tokens generated per completion")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "post_training.json"))
    # a variant's own process:
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        Path(a.result).write_text(json.dumps(run_variant(a)))
        return

    preset = PRESETS[a.preset]
    a.seq_len, a.pairs = preset["seq_len"], preset["pairs"]
    with tempfile.TemporaryDirectory() as tmp:
        from spindle.models.qwen3.tiny import build_tiny

        a.folder = build_tiny(Path(tmp) / "model", seed=0, transformer=preset["model"])
        a.data = write_pairs(Path(tmp) / "pairs.jsonl", a.pairs, preset["words"])
        dpo = {}
        for variant in DPO_VARIANTS:
            print(f"running {variant} ...", flush=True)
            r = in_process(a, variant, Path(tmp) / f"{variant}.json")
            dpo[variant] = dict(r, step_s=statistics.median(r["step_times"]))
        print("running grpo ...", flush=True)
        grpo = in_process(a, "grpo", Path(tmp) / "grpo.json")

    rows = [dict(variant=k, processes=1, **v) for k, v in dpo.items()]
    common.print_table(
        [
            *common.variant_columns(14),
            ("peak MiB", "peak_mem_mib", ">10", ".0f"),
            ("step MiB", "step_mem_mib", ">10", ".0f"),
            ("step-1 loss", "first_loss", ">13", ".6f"),  # the same work: the same first loss
        ],
        rows,
    )
    print(
        f"\nGRPO ({grpo['prompts_per_step']} prompts x 8 completions, median length {grpo['completion_length']:.0f}): "
        f"{grpo['generated_tokens_per_s']:.0f} generated tokens/s; step {grpo['step_s']:.3f}s = generation "
        f"{grpo['generation_s']:.3f}s + scoring {grpo['scoring_s']:.4f}s + update {grpo['update_s']:.3f}s"
    )
    import trl

    report = dict(
        bench="post_training",
        preset=a.preset,
        device=common.describe_device(),
        torch=torch.__version__,
        trl=trl.__version__,
        model=preset["model"],
        pairs_per_step=a.pairs,
        seq_len=a.seq_len,
        warmup=a.warmup,
        timed_steps=a.steps,
        dpo=dpo,
        grpo=grpo,
    )
    common.write_report(report, a.out)


if __name__ == "__main__":
    main()
