"""Per-step metrics: throughput, metrics.jsonl, TensorBoard event files, and the progress bar.

TensorBoard: `output_dir/tensorboard/` (next to metrics.jsonl) gets every scalar of the jsonl line
under `train/<name>` and the validation samples under `samples/<prompt index>`; on by default
(`train.tensorboard`) when the tensorboard package is installed, silently off when it is not.
`tensorboard --logdir OUTPUT_DIR` shows the curves; `spindle plot OUTPUT_DIR` draws loss.png without it.

Both records start where training starts: a resumed run drops the lines and events of steps it will
run again, a run starting over drops them all. A torn last line (an append cut short by a crash or
a full disk) is dropped with a warning; a damaged line before it is an error naming `file:line`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spindle.distributed.integrity import DiskFullError, is_disk_full

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger("spindle.train")


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
        self.path = output_dir / METRICS_FILE
        self.bar = tqdm(
            total=max_steps, initial=start_step, desc="train", unit="step", disable=not enabled, dynamic_ncols=True
        )
        self.writer = None
        if enabled and tensorboard and tensorboard_available():
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: readers drop earlier events of the steps this run will (re-)run, like
            # metrics.jsonl (all of them when starting over)
            self.writer = SummaryWriter(str(output_dir / TENSORBOARD_DIR), purge_step=start_step + 1)
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
    ) -> dict[str, Any]:
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
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                if not is_disk_full(e):
                    raise
                raise DiskFullError(
                    f"No space left on device while appending step {step} to {self.path}; free space, then run "
                    "again with checkpoint.resume=auto (the torn line is dropped on resume)",
                    self.path,
                ) from e
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


def _parse_lines(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """-> ([(line, record)], whether a torn last line was dropped). A damaged line before the last
    one is a ValueError naming file:line."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    parsed: list[tuple[str, dict[str, Any]]] = []
    for i, raw in enumerate(lines[: last + 1]):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
            record = json.loads(text)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer step")
        except ValueError as e:
            if i == last and not data.endswith(b"\n"):  # an append cut short (a line is written with its newline)
                log.warning("%s:%d: dropping a torn last line (%r...)", path, i + 1, raw[:40])
                return parsed, True
            raise ValueError(
                f"{path}:{i + 1}: not a metrics record ({e}); delete or fix the line (each line is one step's JSON)"
            ) from None
        parsed.append((text, record))
    return parsed, False


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, one per step (a torn last line is left out)."""
    return [record for _, record in _parse_lines(Path(output_dir) / METRICS_FILE)[0]]


def truncate_metrics(output_dir: Path, last_step: int) -> None:
    """Keep only the lines of steps up to `last_step` (those a resumed run does not run again)."""
    path = output_dir / METRICS_FILE
    if not path.is_file():
        return
    parsed, torn = _parse_lines(path)
    kept = [line for line, record in parsed if record["step"] <= last_step]
    if torn or len(kept) < len(parsed):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)  # a crash here leaves the old file or the new one, never half of one
