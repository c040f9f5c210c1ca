"""Peak memory with and without offload: inference block swap / text-encoder offload / VAE tiling, and
LoRA training with the frozen base in fp32 vs bf16 (`train.frozen_dtype`) and FSDP2 CPU offload.

Every variant runs in a fresh process (peak RSS and CUDA's max_memory_allocated are high-water marks
since the process started) on the same random Wan-shaped checkpoint:

  infer/plain              load_generator + one request
  infer/swap_all           blocks_to_swap = every block (streamed from host with prefetch)
  infer/swap_all+te+tiling ... + text_encoder_offload + vae_tiling
  train/lora_fp32_frozen   LoRA, mixed_precision bf16, frozen base stored fp32 (frozen_dtype float32)
  train/lora_bf16_frozen   the same with the frozen base in bf16 (frozen_dtype auto)
  train/lora_cpu_offload   bf16 frozen base + train.cpu_offload (FSDP2 CPUOffloadPolicy)

Freed host memory goes back to the OS (`keep_freed_memory` off), so "host end" (RSS while the model
is alive, at the end; anonymous memory only) is live memory. Columns: host peak RSS, host end, device peak (CUDA only), the transformer-block bytes resident on the device at
once (block swap's own count; on CPU host and device are the same memory, so this column is the one
that shows what swapping saves there), the frozen-parameter bytes, and seconds.

  python bench/memory.py --preset cpu --json bench-memory.json
  python bench/memory.py --preset wan1.3b        # on a GPU (bf16; 480x832, 81 frames)
  python bench/memory.py --preset wan14b         # on a GPU: Wan2.1-14B block shapes, random weights
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402

PRESETS = {
    "cpu": dict(
        **common.WAN_SMALL,
        request=dict(height=128, width=128, num_frames=9, num_inference_steps=4, guidance_scale=5.0),
        train=dict(resolution=[64, 64], num_frames=9, steps=2),
        dtype="float32",
    ),
    "cpu-large": dict(  # 12 blocks 768 wide (~115M transformer parameters, 0.46 GB fp32): frozen_dtype shows in RSS
        transformer=dict(
            num_layers=12,
            num_attention_heads=12,
            attention_head_dim=64,
            ffn_dim=3072,
            in_channels=16,
            out_channels=16,
            freq_dim=64,
            rope_max_seq_len=256,
        ),
        vae=dict(base_dim=8, z_dim=16),
        text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
        request=dict(height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0),
        train=dict(resolution=[32, 32], num_frames=5, steps=2),
        dtype="float32",
    ),
    "wan1.3b": dict(  # Wan2.1-T2V-1.3B transformer + VAE shapes; a thin random text encoder of width 4096
        **common.WAN_1_3B,
        request=dict(height=480, width=832, num_frames=81, num_inference_steps=4, guidance_scale=5.0),
        train=dict(resolution=[480, 832], num_frames=33, steps=2),
        dtype="bfloat16",
    ),
    "wan14b": dict(  # Wan2.1-T2V-14B block shapes (5120 wide, 40 heads x 128, 40 layers)
        transformer=dict(
            num_layers=40,
            num_attention_heads=40,
            attention_head_dim=128,
            ffn_dim=13824,
            in_channels=16,
            out_channels=16,
            freq_dim=256,
            rope_max_seq_len=1024,
            eps=1e-6,
        ),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
        text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=2, num_heads=8),
        request=dict(height=480, width=832, num_frames=81, num_inference_steps=4, guidance_scale=5.0),
        train=dict(resolution=[480, 832], num_frames=33, steps=2),
        dtype="bfloat16",
    ),
}
COMPONENTS = ("transformer", "vae", "text_encoder")
INFER = {
    "infer/plain": {},
    "infer/swap_all": {"blocks_to_swap": "all"},
    "infer/swap_all+te+tiling": {"blocks_to_swap": "all", "text_encoder_offload": True, "vae_tiling": True},
}
TRAIN = {
    "train/lora_fp32_frozen": ["train.frozen_dtype=float32"],
    "train/lora_bf16_frozen": ["train.frozen_dtype=auto"],
    "train/lora_cpu_offload": ["train.frozen_dtype=auto", "train.cpu_offload=true"],
}


def build_checkpoint(preset: str, root: Path) -> Path:
    from spindle.testing.tiny import build_tiny

    if (root / "model_index.json").is_file():
        return root
    p = PRESETS[preset]
    return build_tiny("wan", root, seed=0, **{k: p[k] for k in COMPONENTS if k in p})


def host_peak_gb() -> float:
    from spindle.train.memory import host_peak_bytes

    return host_peak_bytes() / 1e9


def host_now_gb() -> float:
    """Anonymous resident memory now (Linux /proc `RssAnon`), after glibc's malloc_trim: what is alive in
    the process. File-backed pages are left out: diffusers memory-maps the safetensors it loads, and
    pages of that file that were read count in RSS (the peak column includes them) but are clean
    page cache the OS can drop. malloc_trim hands freed heap chunks (tensors of a few MB) back."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    status = Path("/proc/self/status").read_text()
    kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:"))
    return kib * 1024 / 1e9


def device_peak_gb() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def infer_child(preset: str, root: Path, options: dict) -> dict:
    from spindle.api import load_generator
    from spindle.distributed.blocks import find_blocks

    p = PRESETS[preset]
    if options.get("blocks_to_swap") == "all":
        options = {**options, "blocks_to_swap": p["transformer"]["num_layers"]}
    start = time.perf_counter()
    gen = load_generator(root, dtype=p["dtype"], keep_freed_memory=False, **options)
    blocks = find_blocks(gen.transformer)
    gen.generate(prompt="a red panda climbing a snowy tree", seed=0, **p["request"])
    seconds = time.perf_counter() - start
    swap = gen.pipeline.offloads.get("transformer")
    block_bytes = sum(t.numel() * t.element_size() for b in blocks for t in [*b.parameters(), *b.buffers()])
    resident = swap.max_resident_bytes + block_bytes - sum(swap.unit_bytes) if swap is not None else block_bytes
    # host_now_gb: measured while the generator is alive (its weights, caches)
    return dict(resident_block_gb=resident / 1e9, frozen_gb=None, seconds=seconds, host_now_gb=host_now_gb())


def train_child(preset: str, root: Path, overrides: list[str], work: Path) -> dict:
    from spindle.api import load_job_config, make_trainer
    from spindle.data.synthetic import make_shapes_video_dataset

    t = PRESETS[preset]["train"]
    data = make_shapes_video_dataset(
        work / "data", num_videos=2, num_frames=t["num_frames"], size=tuple(t["resolution"])
    )
    cfg = load_job_config(
        None,
        [
            f"model.path={root}",
            "model.max_text_length=64",
            f"data.path={data}",
            f"data.resolution={t['resolution']}",
            f"data.num_frames={t['num_frames']}",
            f"train.output_dir={work / 'run'}",
            f"train.max_steps={t['steps']}",
            "train.lora={rank: 16}",
            "train.mixed_precision=bf16",
            "train.tensorboard=false",
            "checkpoint.export=false",
            "train.keep_freed_memory=false",
            *overrides,
        ],
    )
    start = time.perf_counter()
    trainer = make_trainer(cfg)
    trainer.run()
    seconds = time.perf_counter() - start
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
    after_load = trainer.peak_memory["after load"][0]
    return dict(
        resident_block_gb=None,
        frozen_gb=frozen_bytes / 1e9,
        seconds=seconds,
        load_host_gb=after_load.host_peak_gb,
        host_now_gb=host_now_gb(),  # while the trainer (model, optimizer state) is alive
    )


def child(args: argparse.Namespace) -> None:
    root = Path(args.model)
    with tempfile.TemporaryDirectory() as work:
        if args.variant in INFER:
            row = infer_child(args.preset, root, dict(INFER[args.variant]))
        else:
            row = train_child(args.preset, root, TRAIN[args.variant], Path(work))
    row.update(variant=args.variant, host_peak_gb=host_peak_gb(), device_peak_gb=device_peak_gb())
    print("RESULT " + json.dumps(row))


def run_variant(args: argparse.Namespace, root: Path, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--preset", args.preset, "--model", str(root)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--model", default=None, help="reuse a checkpoint folder (default: build one)")
    parser.add_argument("--only", choices=("infer", "train"), default=None)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.variant = args.child
        child(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.model) if args.model else build_checkpoint(args.preset, Path(tmp) / "ckpt")
        variants = [v for v in (*INFER, *TRAIN) if args.only is None or v.startswith(args.only)]
        rows = [run_variant(args, root, v) for v in variants]
    columns: list[common.Column] = [
        ("variant", "variant", "<26", ""),
        ("host peak GB", lambda r: gb(r["host_peak_gb"]), ">13", ""),
        ("host end anon GB", lambda r: gb(r["host_now_gb"]), ">17", ""),
        ("device peak GB", lambda r: gb(r["device_peak_gb"]), ">15", ""),
        ("blocks on device GB", lambda r: gb(r["resident_block_gb"]), ">20", ""),
        ("frozen GB", lambda r: gb(r["frozen_gb"]), ">10", ""),
        ("s", "seconds", ">8", ".1f"),
    ]
    print(f"preset {args.preset} on {common.describe_device()}")
    common.print_table(columns, rows)
    if args.json:
        common.write_report({"preset": args.preset, "device": common.describe_device(), "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
