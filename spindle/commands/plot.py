"""Draw a run's training curve from its metrics.jsonl (no TensorBoard needed).

  spindle plot OUTPUT_DIR [--out loss.png] [--smoothing 0.9]

Writes OUTPUT_DIR/loss.png: the loss per step, its exponential moving average (TensorBoard's
debiased smoothing), and the learning rate on a second axis.
"""

from __future__ import annotations

import argparse
from pathlib import Path

LOADS_MODELS = False  # no diffusers import just to silence it (spindle.quiet)
HELP = "plot a run's loss (raw + smoothed) and learning rate to loss.png"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a training output_dir (holding metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/loss.png)")
    p.add_argument("--smoothing", type=float, default=0.9, help="EMA weight in [0, 1) (default 0.9)")


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased for the first points."""
    out, ema = [], 0.0
    for i, value in enumerate(values, start=1):
        ema = weight * ema + (1 - weight) * value
        out.append(ema / (1 - weight**i))
    return out


def plot(run_dir: str | Path, out: str | Path | None = None, smoothing: float = 0.9) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from spindle.train.metrics import read_metrics

    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir}/metrics.jsonl not found: pass a training output_dir")
    if not 0 <= smoothing < 1:
        raise ValueError(f"--smoothing must be in [0, 1); got {smoothing}")
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    steps = [r["step"] for r in records]
    loss = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, loss, color="tab:blue", alpha=0.35, linewidth=1, label="loss")
    ax.plot(steps, smooth(loss, smoothing), color="tab:blue", linewidth=2, label=f"loss (EMA {smoothing})")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [r["lr"] for r in records], color="tab:orange", linewidth=1.5, label="lr")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_ylim(bottom=0)  # a constant lr reads as constant, not as a zoomed-in wiggle
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    lines = ax.get_lines() + lr_ax.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="upper right")
    ax.set_title(f"{run_dir.name}: {len(steps)} steps, last loss {loss[-1]:.4f}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    out = plot(args.run_dir, args.out, args.smoothing)
    print(f"wrote {out}")
    return 0
