"""VLM training benchmark: Spindle's VLM task (padded rows, packed rows) vs the plain loop a user writes with
transformers + AdamW, on the same model folder (Qwen2.5-VL-shaped, or the family a preset names: Qwen3.5), image
conversations and machine.

    python bench/train_vlm.py                       # CPU preset: a small Qwen2.5-VL, 24 conversations
    python bench/train_vlm.py --preset qwen2.5-vl-7b --conversations 64   # Qwen2.5-VL-7B's shape (GPU)
    python bench/train_vlm.py --preset qwen3.5-9b --conversations 64      # Qwen3.5-9B's shape (GPU; qwen3.5-cpu: small)

Variants, each in its own process (peak memory per variant: RSS on CPU, max_memory_allocated on CUDA):
  transformers     batches of `--batch` conversations padded to the longest, `model(input_ids, attention_mask,
                   pixel_values, image_grid_thw, mm_token_type_ids, labels).loss`, clip, torch AdamW
  spindle_padded   Spindle's VLM task, `data.packing: false` (one conversation per row, each micro-batch padded to
                   its longest, as transformers), micro batch `--batch`
  spindle_packed   Spindle's VLM task, `data.packing: true` (conversations end to end in `seq_len` rows)
Every variant trains over the same conversations once per timed epoch; the figure is real (non-padding)
tokens per second, so padding costs what it costs. One warm-up epoch, then `--epochs` timed ones (median).
Writes JSON (--out, default bench/results/train_vlm[-PRESET].json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.config_memory import REAL  # noqa: E402  (after the sys.path line above)

# transformers' Qwen3_5Config defaults (Qwen/Qwen3.5-9B's shape), as the real-size config's memory estimate reads them
QWEN3_5_9B = REAL["qwen3_5_9b.yaml"].config

PRESETS = {
    "cpu": dict(
        text=dict(
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
        ),
        vision=dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4),
        image=(112, 168),
        max_pixels=112 * 168,
        seq_len=512,
        batch=4,
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json shape (random weights: nothing is downloaded)
    "qwen2.5-vl-7b": dict(
        text=dict(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=152064,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        ),
        vision=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        image=(448, 672),
        max_pixels=448 * 672,
        seq_len=4096,
        batch=4,
    ),
    # transformers' Qwen3_5Config defaults (Qwen/Qwen3.5-9B's shape, configs/qwen3_5_9b.yaml): 3 of every 4 layers
    # Gated DeltaNet, the 4th full attention; the Qwen3-VL vision tower (patch 16, merge 2)
    "qwen3.5-9b": dict(
        family="qwen3_5",
        packing_refused=True,
        text=QWEN3_5_9B["text_config"],
        vision=QWEN3_5_9B["vision_config"],
        image=(448, 672),
        max_pixels=448 * 672,
        seq_len=4096,
        batch=4,
    ),
}
# the CPU smoke shape of each further family a preset names (the text/vision dicts above are Qwen2.5-VL's)
PRESETS["qwen3.5-cpu"] = dict(
    family="qwen3_5",
    packing_refused=True,
    text=dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    ),
    vision=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, out_hidden_size=256),
    image=(112, 168),
    max_pixels=112 * 168,
    seq_len=512,
    batch=4,
)
VARIANTS = ("transformers", "spindle_padded", "spindle_packed")


def build(a: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    from spindle.data.synthetic import make_image_conversations
    from spindle.testing.tiny import build_tiny

    p = PRESETS[a.preset]
    # the family's registered tiny builder with the preset's shapes (random weights: nothing is downloaded)
    overrides = {"text_config": p["text"], "vision_config": p["vision"]}
    model = build_tiny(p.get("family", "qwen2_5_vl"), work / "model", seed=0, transformer=overrides)
    data = make_image_conversations(work / "data", a.conversations, size=p["image"], text_only_every=3)
    return model, data


def peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def epochs_timed(a: argparse.Namespace, device: torch.device, epoch) -> list[float]:
    times = []
    for i in range(1 + a.epochs):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        epoch()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def spindle_variant(a: argparse.Namespace, model: Path, data: Path, packing: bool, device: torch.device) -> dict:
    from spindle.api import load_job_config, make_trainer

    p = PRESETS[a.preset]
    batch = p["batch"] if not packing else 1
    overrides = [
        f"model.path={model}",
        f"data.path={data}",
        f"data.seq_len={p['seq_len']}",
        f"data.packing={packing}",
        f"data.max_pixels={p['max_pixels']}",
        "data.shuffle=false",
        f"train.micro_batch_size={batch}",
        f"train.global_batch_size={batch}",
        "train.lr=1e-5",
        f"train.output_dir={data.parent / 'run'}",
        "checkpoint.export=false",
    ]
    trainer = make_trainer(load_job_config(None, overrides))
    dataset = trainer.loader.dataset
    steps = len(dataset) // batch
    real = sum(int(dataset[i]["attention_mask"].sum()) for i in range(steps * batch))
    times = epochs_timed(a, device, lambda: [trainer.train_step() for _ in range(steps)])
    return dict(real_tokens=real, rows=len(dataset), epoch_times=times)


def transformers_variant(a: argparse.Namespace, model_path: Path, data: Path, device: torch.device) -> dict:
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from spindle.data.multimodal import VisionOptions, VisionProcessor, collate_vision, read_conversations
    from spindle.models.shared.vlm_rope import mm_token_types
    from spindle.registry import get_family

    p = PRESETS[a.preset]
    config = AutoConfig.from_pretrained(model_path)
    tok = AutoTokenizer.from_pretrained(model_path)
    options = VisionOptions(max_pixels=p["max_pixels"])
    family = get_family(p.get("family", "qwen2_5_vl"))
    processor = VisionProcessor(model_path, tok, config, family.rope_index_fn(), options)
    docs, _, _ = read_conversations(data, processor, 1 << 20)
    batches = []
    for i in range(0, len(docs) - len(docs) % p["batch"], p["batch"]):
        group = docs[i : i + p["batch"]]
        width = max(len(d.tokens) for d in group)
        ids = torch.tensor([d.tokens + [tok.pad_token_id] * (width - len(d.tokens)) for d in group])
        mask = torch.tensor([[1] * len(d.tokens) + [0] * (width - len(d.tokens)) for d in group])
        labels = torch.tensor(
            [
                [t if k else -100 for t, k in zip(d.tokens, d.learn, strict=True)] + [-100] * (width - len(d.tokens))
                for d in group
            ]
        )
        vision = collate_vision([v for d in group for v in d.vision])
        inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, mm_token_type_ids=mm_token_types(config, ids))
        batches.append({k: v.to(device) for k, v in {**inputs, **vision}.items()})
    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = device.type == "cuda"

    def epoch():
        for inputs in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                loss = model(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    real = sum(int(b["attention_mask"].sum()) for b in batches)
    return dict(
        real_tokens=real, rows=sum(b["input_ids"].shape[0] for b in batches), epoch_times=epochs_timed(a, device, epoch)
    )


def run_one(a: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, data = Path(a.model), Path(a.data)
    if a.variant == "transformers":
        result = transformers_variant(a, model, data, device)
    else:
        result = spindle_variant(a, model, data, a.variant == "spindle_packed", device)
    result["peak_mem_mib"] = peak_mib(device)
    Path(a.json).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--epochs", type=int, default=2, help="timed epochs after one warm-up epoch")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.variant:
        return run_one(a)
    with tempfile.TemporaryDirectory() as tmp:
        model, data = build(a, Path(tmp))
        rows = []
        # a family whose layers carry state across a row (Qwen3.5's Gated DeltaNet) refuses packing: no packed row
        refused = PRESETS[a.preset].get("packing_refused", False)
        for variant in [v for v in a.variants if not (refused and v == "spindle_packed")]:
            out = Path(tmp) / f"{variant}.json"
            cmd = [sys.executable, __file__, "--preset", a.preset, "--conversations", str(a.conversations)]
            cmd += ["--epochs", str(a.epochs), "--variant", variant, "--model", str(model), "--data", str(data)]
            proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            r = json.loads(out.read_text())
            epoch = statistics.median(r["epoch_times"])
            rows.append(dict(variant=variant, **r, epoch_s=epoch, real_tokens_per_s=r["real_tokens"] / epoch))
    base = rows[0]["real_tokens_per_s"]
    print(
        f"{'variant':<16} {'rows':>5} {'real tok':>9} {'epoch s':>8} {'real tok/s':>11} {'vs first':>8} {'peak MiB':>9}"
    )
    for r in rows:
        print(
            f"{r['variant']:<16} {r['rows']:>5} {r['real_tokens']:>9} {r['epoch_s']:>8.2f} "
            f"{r['real_tokens_per_s']:>11.1f} {r['real_tokens_per_s'] / base:>7.2f}x {r['peak_mem_mib']:>9.0f}"
        )
    name = "train_vlm.json" if a.preset == "cpu" else f"train_vlm-{a.preset}.json"
    out_path = Path(a.out or ROOT / "bench" / "results" / name)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(
        json.dumps(
            dict(
                preset=a.preset,
                device=str(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"),
                results=rows,
            ),
            indent=2,
        )
    )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
