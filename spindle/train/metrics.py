"""Per-step metrics: throughput, metrics.jsonl, and the progress bar."""

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


class MetricsLog:
    """Appends one JSON line per step to metrics.jsonl (rank 0 only) and drives a tqdm bar."""

    def __init__(self, output_dir: Path, start_step: int, max_steps: int, enabled: bool):
        self.enabled = enabled
        self.path = output_dir / "metrics.jsonl"
        self.bar = tqdm(
            total=max_steps, initial=start_step, desc="train", unit="step", disable=not enabled, dynamic_ncols=True
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
        return record

    def close(self) -> None:
        self.bar.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
