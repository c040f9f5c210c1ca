"""Plumbing the benchmarks share: peak FLOPs for MFU, the results table, the JSON report."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Wan-shaped tiny checkpoints the inference and memory benches build (spindle.models.wan.tiny overrides):
# the small CPU shape and Wan2.1-T2V-1.3B's transformer + VAE with a thin random text encoder of width 4096.
WAN_SMALL = dict(
    transformer=dict(
        num_layers=8,
        num_attention_heads=8,
        attention_head_dim=32,
        ffn_dim=1024,
        in_channels=16,
        out_channels=16,
        freq_dim=64,
        rope_max_seq_len=256,
    ),
    vae=dict(base_dim=8, z_dim=16),
    text_encoder=dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4),
)
WAN_1_3B = dict(
    transformer=dict(
        num_layers=30,
        num_attention_heads=12,
        attention_head_dim=128,
        ffn_dim=8960,
        in_channels=16,
        out_channels=16,
        freq_dim=256,
        rope_max_seq_len=1024,
        eps=1e-6,
    ),
    vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
    text_encoder=dict(d_model=4096, d_kv=64, d_ff=256, num_layers=2, num_heads=8),
)

# Dense bf16 peak of one device, by a substring of its CUDA name (MFU's denominator).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12}


def peak_flops(device_name: str, cuda: bool) -> float | None:
    """The device's bf16 peak, or None (CPU, or a GPU not in PEAK_BF16_FLOPS: MFU is then not reported)."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None) if cuda else None


def mfu_text(row: dict[str, Any]) -> str:
    return f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"


# A column: (title, the row's key or a function of the row, alignment and width, number format).
Column = tuple[str, "str | Callable[[dict[str, Any]], Any]", str, str]


def variant_columns(width: int) -> list[Column]:
    """The columns every training table starts with: the variant (`width` wide), processes, step time."""
    return [
        ("variant", "variant", f"<{width}", ""),
        ("procs", "processes", ">6", ""),
        ("step s", "step_s", ">9", ".3f"),
    ]


MFU_COLUMN: Column = ("MFU", mfu_text, ">7", "")


def print_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> None:
    """A header, a rule and one line a row, each column `f"{value:{align_width}{number_format}}"`."""
    head = "".join(f"{title:{width}}" for title, _, width, _ in columns)
    print(head)
    print("-" * len(head))
    for row in rows:
        print("".join(f"{key(row) if callable(key) else row[key]:{width}{fmt}}" for _, key, width, fmt in columns))


def write_report(report: dict[str, Any], out: str | Path, **dump: Any) -> Path:
    """`report` as indented JSON at `out` (folders created); says where."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, **dump))
    print(f"wrote {out}")
    return out


def describe_device() -> str:
    """The device the report is about: the first GPU's name, or the CPU's core count."""
    import os

    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"


def rank_device(rank: int):
    """A worker's device: its GPU, or the CPU."""
    import torch

    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def sync(device) -> None:
    """Wait for the device's queued work (CUDA), so that wall-clock step times are the work's."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
