"""The parallel plan: what a task (from its family's model library) tells the one parallelize path
(`spindle.distributed.parallelize.parallelize`), which applies, in this order and nowhere else:

    sequence parallel (Ulysses / ring) -> expert parallel -> activation checkpointing
        -> regional compile -> FSDP2 (experts' units, then each block, then the root)

Light (no torch): a record of names and switches; the path reads the model's own declarations for
the rest (its repeated blocks: `_no_split_modules` / `_repeated_blocks`; its diffusers CP plan
`_cp_plan`; its transformers EP plan `config.base_model_ep_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LIBRARIES = ("diffusers", "transformers")


@dataclass(frozen=True)
class ParallelPlan:
    # Whose hooks the model takes: "diffusers" (diffusers' context-parallel hooks for SP/ring, its
    # `enable_gradient_checkpointing`) or "transformers" (Spindle's Ulysses attention for SP,
    # transformers' non-reentrant `activation_checkpointing_enable`).
    library: str
    # diffusers CP plan overriding the model's `_cp_plan` (None: the model's own).
    cp_plan: dict[str, Any] | None = None
    # Shard the experts over `parallel.ep` (MoE; the model's `config.base_model_ep_plan`).
    expert_parallel: bool = False
    # Class names of the repeated blocks (FSDP2 units, compile regions); empty: the model's own
    # declaration (`_no_split_modules` / `_repeated_blocks`), else ModuleLists named like blocks.
    blocks: tuple[str, ...] = ()
    # Dotted path of the submodule whose attention transformers-library SP replaces ("": the whole
    # model): a VLM's language model, so its vision tower keeps its own attention.
    sequence_parallel_module: str = ""
    # transformers attn_implementation of that submodule (the language model), e.g. "spindle_varlen"
    # (spindle.ops.varlen_attention.implementation_name); under SP, Ulysses' inner attention. "": the model's own.
    attention: str = ""

    def __post_init__(self) -> None:
        if self.library not in LIBRARIES:
            raise ValueError(f"ParallelPlan.library must be one of {LIBRARIES}, got {self.library!r}")
