"""Peak memory per rank, reported at the start of a run (after the model is loaded and after step 1).

Host: the process's peak resident set size (`resource.getrusage(...).ru_maxrss`, a high-water mark
since the process started, so it includes the load). Device: `torch.cuda.max_memory_allocated` on CUDA.
Every rank measures its own; rank 0 logs them all in one line (a collective).
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("spindle.train")
GB = 1e9


@dataclass(frozen=True)
class PeakMemory:
    rank: int
    host_peak_gb: float
    device_peak_gb: float | None  # None: no accelerator


def host_peak_bytes() -> int:
    """This process's peak resident set size in bytes (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def peak_memory(device: torch.device) -> PeakMemory:
    rank = dist.get_rank() if dist.is_initialized() else 0
    on_device = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    return PeakMemory(rank, host_peak_bytes() / GB, on_device)


def gather_peak_memory(device: torch.device) -> list[PeakMemory]:
    """Collective: every rank's `peak_memory`, in rank order (on every rank)."""
    mine = peak_memory(device)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[dict[str, Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, asdict(mine))
    return [PeakMemory(**e) for e in everyone if e is not None]


def format_peak_memory(when: str, peaks: list[PeakMemory]) -> str:
    def one(p: PeakMemory) -> str:
        device = f", device {p.device_peak_gb:.2f} GB" if p.device_peak_gb is not None else ""
        return f"rank {p.rank}: host {p.host_peak_gb:.2f} GB{device}"

    return f"peak memory {when}: " + "; ".join(one(p) for p in peaks)


def report_peak_memory(when: str, device: torch.device) -> list[PeakMemory]:
    """Collective: gather every rank's peak memory; rank 0 logs it. -> the peaks (every rank)."""
    peaks = gather_peak_memory(device)
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(format_peak_memory(when, peaks))
    return peaks


# Bytes per parameter of the training state. Trainable parameters keep fp32 master weights, fp32 gradients
# and AdamW's two fp32 moments (spindle.train.optim); an EMA (`train.ema`) is one more fp32 copy. Frozen
# parameters (a LoRA run's base, a frozen tower) are stored as `train.frozen_dtype` says: their bytes are
# given as they are stored.
TRAINABLE_BYTES = {"weights": 4, "gradients": 4, "optimizer": 8}
EMA_BYTES = 4


@dataclass(frozen=True)
class StateMemory:
    """The training state one rank holds (GB, 1e9 bytes): weights (trainable fp32 + frozen as stored),
    gradients, AdamW moments and the EMA, each sharded over `shards` FSDP2 ranks. Activations, the
    transient all-gathered blocks and the models a task keeps outside the trained one (text encoders,
    VAEs) are not in it."""

    shards: int
    weights_gb: float
    gradients_gb: float
    optimizer_gb: float
    ema_gb: float

    @property
    def total_gb(self) -> float:
        return self.weights_gb + self.gradients_gb + self.optimizer_gb + self.ema_gb

    def describe(self) -> str:
        # GB with one decimal (what the shipped configs state); MB below 1 GB (small models, tests)
        unit, scale = ("GB", 1.0) if self.total_gb >= 1 else ("MB", 1e3)
        ema = f", EMA {self.ema_gb * scale:.1f}" if self.ema_gb else ""
        return (
            f"{self.total_gb * scale:.1f} {unit} per rank over {self.shards} FSDP2 shards (weights "
            f"{self.weights_gb * scale:.1f}, gradients {self.gradients_gb * scale:.1f}, AdamW state "
            f"{self.optimizer_gb * scale:.1f}{ema}; activations not included)"
        )


def state_memory_per_rank(trainable: int, frozen_bytes: int, shards: int, *, ema: bool = False) -> StateMemory:
    """Weights + gradients + optimizer state per rank for `trainable` parameters and `frozen_bytes` of frozen
    ones, sharded evenly over `shards` ranks (FSDP2 over dp_shard x ring x sp; expert parallelism splits the
    experts over ranks of that same group, so it moves no bytes between ranks on average, and HSDP replicas
    each hold a whole sharded copy). Used by the start-of-run summary and by bench/config_memory.py."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    per = {k: trainable * b / shards / GB for k, b in TRAINABLE_BYTES.items()}
    return StateMemory(
        shards=shards,
        weights_gb=per["weights"] + frozen_bytes / shards / GB,
        gradients_gb=per["gradients"],
        optimizer_gb=per["optimizer"],
        ema_gb=trainable * EMA_BYTES / shards / GB if ema else 0.0,
    )


def frozen_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's frozen parameters as stored (a DTensor counts its global shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)


@dataclass(frozen=True)
class ActivationMemory:
    """An estimate of what one rank's forward keeps for the backward of one micro-batch (`activation_memory`)."""

    tokens: int  # tokens of the micro-batch on this rank (after the SP split)
    layers_gb: float  # the decoder layers' saved activations
    mask_gb: float  # a dense [rows, S, S] document mask (the sdpa path on packed rows); 0 on the varlen path

    @property
    def total_gb(self) -> float:
        return self.layers_gb + self.mask_gb

    def describe(self) -> str:
        mask = f", of which the [S, S] document mask {self.mask_gb:.2f}" if self.mask_gb else ""
        return f"~{self.total_gb:.2f} GB per rank for {self.tokens:,} tokens a micro-batch (estimate{mask})"


def activation_memory(
    text_config: dict[str, Any],
    *,
    rows: int,
    seq_len: int,
    sp: int,
    bytes_per_value: int,
    checkpointing: bool,
    dense_mask: bool,
) -> ActivationMemory:
    """What a decoder's forward keeps for its backward on one rank, from its config.json numbers: per layer and
    token about 10 x hidden + 3 x intermediate values (norm inputs, q/k/v, attention output, residuals, the MLP's
    gate/up/activation); with activation checkpointing only each layer's input and one layer's whole set. The loss
    is chunked (no [tokens, vocab] logits). A dense document mask adds rows x S x S bytes of booleans plus the
    additive float copy SDPA makes (5 bytes a pair); the varlen path has none. The sequence is split over `sp`
    ranks (Ulysses). An estimate for planning: it leaves out the framework's own workspace and temporaries."""
    hidden = int(text_config["hidden_size"])
    layers = int(text_config["num_hidden_layers"])
    inter = int(text_config.get("intermediate_size") or text_config.get("moe_intermediate_size") or 4 * hidden)
    tokens = rows * seq_len // max(sp, 1)
    per_layer = tokens * (10 * hidden + 3 * inter) * bytes_per_value
    kept = tokens * hidden * bytes_per_value * layers + per_layer if checkpointing else per_layer * layers
    mask = rows * seq_len * seq_len * 5 if dense_mask else 0
    return ActivationMemory(tokens=tokens, layers_gb=kept / GB, mask_gb=mask / GB)
