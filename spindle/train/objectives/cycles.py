"""Rules for objectives that train each batch of rollouts for several optimizer steps (`num_iterations`).

The trainer calls `begin_step` (the rollouts) once per cycle of `updates_per_batch()` steps and checkpoints only
between cycles, so a checkpoint never holds a half-trained batch of rollouts and a resume needs no rollout buffer.
"""

from __future__ import annotations

from typing import Any


def check_cycle_multiples(section: str, num_iterations: int, cfg: Any) -> None:
    """`<section>.num_iterations` K > 1: `train.max_steps` and `checkpoint.every_steps` must be multiples of K."""
    from spindle.config import ConfigError

    every, steps = cfg.checkpoint.every_steps, cfg.train.max_steps
    if num_iterations > 1 and (steps % num_iterations or (every and every % num_iterations)):
        raise ConfigError(
            f"{section}.num_iterations={num_iterations}: train.max_steps ({steps}) and checkpoint.every_steps "
            f"({every}) must be multiples of it (each batch of rollouts trains {num_iterations} optimizer steps; "
            "checkpoints fall between such cycles, so a resume never needs rollouts half trained)"
        )
