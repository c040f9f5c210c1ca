"""What a run says about itself: a start-of-run summary (what it trains, on what, how, where it writes)
and an end-of-run summary (loss, time, throughput, peak memory), printed by rank 0 before the progress
bar / after it, and kept in the run folder as `summary.json` ({"start": ..., "end": ...}).

Fields other parts of Spindle measure go in the start summary's `extra` dict (the trainer's
`summary_extra`, e.g. memory after load): printed as `key: value` lines and written with the rest.
"""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from spindle.train.memory import ActivationMemory, StateMemory

SUMMARY_FILE = "summary.json"

# what each dimension of the mesh does, for the summary (only dimensions larger than 1 are listed)
DIM_ROLES = {
    "dp_replicate": "HSDP replica groups: whole copies of the sharded model, gradients averaged between them",
    "dp_shard": "FSDP2: parameters, gradients and optimizer state sharded; each rank takes its share of the batch",
    "sp": "Ulysses sequence parallel: each sample's tokens split, attention heads exchanged",
    "ring": "ring attention: each sample's tokens split, keys/values passed around the ring",
    "ep": "expert parallel: the experts split over these ranks of dp_shard x sp",
}


# how the summary names a resolved mixed precision ("no": no autocast, the weights' own fp32)
PRECISION_NAMES = {"no": "fp32"}


def say(message: str) -> None:
    """A line for the user that never lands inside a progress bar (call on rank 0 only)."""
    tqdm.write(message)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of the whole model (a DTensor counts its global shape)."""
    trainable = frozen = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def mesh_layout(dims: Any) -> dict[str, Any]:
    """{"world": N, "dims": {name: size}, "roles": {name: what it does}} for the resolved parallel dims."""
    sizes = {name: int(getattr(dims, name)) for name in DIM_ROLES}
    world = sizes["dp_replicate"] * sizes["dp_shard"] * sizes["sp"] * sizes["ring"]
    return {
        "world": world,
        "dims": sizes,
        "roles": {name: role for name, role in DIM_ROLES.items() if sizes[name] > 1},
    }


def epochs_for(max_steps: int, global_batch_size: int, data: dict[str, Any]) -> float | None:
    """How many passes over the data `max_steps` makes (None when the task reports no row count)."""
    rows = data.get("rows")
    return round(max_steps * global_batch_size / rows, 3) if isinstance(rows, int) and rows > 0 else None


def format_start(summary: dict[str, Any]) -> str:
    data = ", ".join(f"{k} {v}" for k, v in summary["data"].items() if not isinstance(v, dict))
    # per-group counts (data.sources, data.buckets): a line each, "name key n, key n; name ..."
    groups = [
        f"data {key}: "
        + "; ".join(f"{name} " + ", ".join(f"{k} {n}" for k, n in counts.items()) for name, counts in v.items())
        for key, v in summary["data"].items()
        if isinstance(v, dict)
    ]
    params = summary["parameters"]
    mesh = summary["mesh"]
    layout = "; ".join(f"{name}={mesh['dims'][name]} ({role})" for name, role in mesh["roles"].items())
    resume = summary["resume"]
    lines = [
        f"run: {summary['family']} ({summary['task']} task), {summary['max_steps']} steps of "
        f"{summary['global_batch_size']} samples, precision {PRECISION_NAMES.get(p := summary['precision'], p)}",
        f"data: {data or 'no counts'}" + (f"; {summary['epochs']} epochs" if summary["epochs"] is not None else ""),
        *groups,
        f"parameters: {params['trainable']:,} trainable, {params['frozen']:,} frozen",
        *([f"training state: {state_memory_line(summary['state_memory'])}"] if "state_memory" in summary else []),
        *([f"activations: {activation_line(summary['activation_memory'])}"] if "activation_memory" in summary else []),
        f"mesh: {mesh['world']} processes: {layout}" if mesh["world"] > 1 else "mesh: one process, no parallelism",
        f"start: step {resume['step']}" + (f" (checkpoint {resume['checkpoint']})" if resume["checkpoint"] else ""),
        "outputs: " + ", ".join(f"{k} {v}" for k, v in summary["outputs"].items()),
        *(f"{key}: {value}" for key, value in summary["extra"].items()),
    ]
    return "\n".join(lines)


def activation_line(fields: dict[str, Any]) -> str:
    """The summary's `activation_memory` (spindle.train.memory.ActivationMemory as a dict) as one line."""
    return ActivationMemory(**{k: v for k, v in fields.items() if k != "total_gb"}).describe()


def state_memory_line(fields: dict[str, Any]) -> str:
    """The summary's `state_memory` (spindle.train.memory.StateMemory as a dict) as one line."""
    return StateMemory(**fields).describe()


def peak_memory() -> dict[str, Any]:
    """This process's peak memory: CUDA allocator peak on a GPU, resident set size on the CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"kind": "cuda_allocated", "gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)}
    return {"kind": "process_rss", "gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


@dataclass
class EndTracker:
    """Running figures for the end-of-run summary (fed once per step)."""

    start_step: int
    t0: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0

    def step(self, loss: float, samples: int, tokens: int) -> None:
        self.losses.append(loss)
        self.samples += samples
        self.tokens += tokens

    def finish(self, last_step: int) -> dict[str, Any]:
        seconds = time.perf_counter() - self.t0
        return {
            "steps": last_step - self.start_step,
            "last_step": last_step,
            "loss_first": self.losses[0] if self.losses else None,
            "loss_last": self.losses[-1] if self.losses else None,
            "seconds": round(seconds, 3),
            "samples_per_s": round(self.samples / seconds, 3) if seconds else None,
            "tokens_per_s": round(self.tokens / seconds, 3) if seconds else None,
            "peak_memory": peak_memory(),
        }


def format_end(end: dict[str, Any]) -> str:
    loss = (
        f"loss {end['loss_first']:.4f} -> {end['loss_last']:.4f}" if end["loss_first"] is not None else "no steps run"
    )
    memory = end["peak_memory"]
    return (
        f"done: {end['steps']} steps in {end['seconds']:.1f} s ({loss}; {end['samples_per_s']} samples/s, "
        f"{end['tokens_per_s']} tokens/s; peak memory {memory['gib']} GiB {memory['kind']})"
    )


def write_summary(output_dir: Path, **parts: dict[str, Any]) -> None:
    """Rank 0: merge `parts` (start=..., end=...) into the run folder's summary.json."""
    path = output_dir / SUMMARY_FILE
    current: dict[str, Any] = {}
    if path.is_file():
        try:
            current = json.loads(path.read_text())
        except json.JSONDecodeError:
            current = {}
    if "start" in parts:
        current.pop("end", None)  # a new start makes the old end stale
    current.update(parts)
    path.write_text(json.dumps(current, indent=2) + "\n")
