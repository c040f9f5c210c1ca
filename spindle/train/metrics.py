"""Per-step metrics: throughput, metrics.jsonl, TensorBoard event files, and the progress bar.

TensorBoard: `output_dir/tensorboard/` (next to metrics.jsonl) gets every scalar of the jsonl line
under `train/<name>` and the validation samples under `samples/<prompt index>`; on by default
(`train.tensorboard`) when the tensorboard package is installed, silently off when it is not.
`tensorboard --logdir OUTPUT_DIR` shows the curves; `spindle plot OUTPUT_DIR` draws loss.png without it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm


def count_tokens(hidden_states: torch.Tensor, patch_size: Any) -> int:
    """Transformer sequence length per sample: packed [B, L, C] inputs, or [B, C, *spatial] / patch."""
    if hidden_states.ndim == 3:
        return int(hidden_states.shape[1])
    spatial = hidden_states.shape[2:]
    patch = list(patch_size) if isinstance(patch_size, (list, tuple)) else [patch_size] * len(spatial)
    patch = [1] * (len(spatial) - len(patch)) + patch
    return int(math.prod(s // p for s, p in zip(spatial, patch, strict=True)))


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    """Appends one JSON line per step to metrics.jsonl (rank 0 only), mirrors it to TensorBoard, and
    drives a tqdm bar."""

    def __init__(self, output_dir: Path, start_step: int, max_steps: int, enabled: bool, tensorboard: bool = True):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.bar = tqdm(
            total=max_steps, initial=start_step, desc="train", unit="step", disable=not enabled, dynamic_ncols=True
        )
        self.writer = None
        if enabled and tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run drops the events of steps it will re-run (like metrics.jsonl)
            self.writer = SummaryWriter(
                str(output_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None
            )
        self._t0 = time.perf_counter()

    def start_step(self) -> None:
        self._t0 = time.perf_counter()

    def end_step(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        lr: float,
        samples: int,
        tokens: int,
        extra: dict[str, float] | None = None,
    ) -> dict:
        """Record one step; `extra`: task-specific scalars (e.g. an MoE aux loss), logged as they are."""
        dt = time.perf_counter() - self._t0
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "samples_per_s": samples / dt,
            "tokens_per_s": tokens / dt,
            "step_time_s": dt,
            **(extra or {}),
        }
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            self.bar.set_postfix(
                loss=f"{loss:.4f}", gnorm=f"{grad_norm:.3f}", lr=f"{lr:.2e}", samples_s=f"{record['samples_per_s']:.2f}"
            )
            self.bar.update(1)
            if self.writer is not None:
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self.writer.add_scalar(f"train/{key}", value, step)
                self.writer.flush()
        return record

    def log_sample(self, step: int, index: int, frames: Any) -> None:
        """A validation sample ([H, W, 3] image or [F, H, W, 3] video, floats in [0, 1]) to TensorBoard.
        Videos go in as their frames side by side (TensorBoard's own video panel needs moviepy)."""
        if self.writer is None:
            return
        import numpy as np

        frames = np.asarray(frames, dtype=np.float32)
        if frames.ndim == 4:
            frames = np.concatenate(list(frames), axis=1)  # [H, F*W, 3]
        self.writer.add_image(f"samples/{index}", frames.clip(0, 1), step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
