"""Per-token log-probabilities of completions: the input of every preference and RL loss.

From hidden states (what Spindle's patched forwards compute the loss from) through the chunked
`spindle.ops.losses.linear_log_probs`, which never holds more than one chunk of [tokens, vocab] logits; or from a
model's logits (a stock forward). Labels are pre-shifted as in Spindle's rows (`shift_labels`: the token position
t predicts, -100 where nothing is scored), so a position's value is log p(label | tokens up to t).
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.ops.losses import linear_log_probs

IGNORE_INDEX = -100


def token_log_probs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    shift_labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """[B, T] fp32 log-probabilities of `shift_labels` [B, T] from `hidden_states` [B, T, H] (0 where -100)."""
    return linear_log_probs(
        hidden_states,
        lm_head_weight,
        shift_labels,
        ignore_index=IGNORE_INDEX,
        chunk_size=chunk_size,
        bias=bias,
        temperature=temperature,
    )


def token_log_probs_from_logits(
    logits: torch.Tensor, shift_labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """[B, T] fp32 log-probabilities of `shift_labels` from full `logits` [B, T, V] (0 where -100)."""
    valid = shift_labels != IGNORE_INDEX
    scores = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = scores.gather(-1, torch.where(valid, shift_labels, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


def sequence_log_probs(per_token: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (summed log-probability [B], scored tokens [B]) of each row: what DPO compares."""
    valid = shift_labels != IGNORE_INDEX
    return (per_token * valid).sum(dim=-1), valid.sum(dim=-1)


def reference_log_probs(
    task: Any, model: torch.nn.Module, rows: dict[str, torch.Tensor], reference: Any, **kwargs: Any
) -> torch.Tensor:
    """`reference_run`'s per-token log-probabilities."""
    logps: torch.Tensor = reference_run(task, model, rows, reference, **kwargs).log_probs
    return logps


def reference_run(
    task: Any, model: torch.nn.Module, rows: dict[str, torch.Tensor], reference: Any, **kwargs: Any
) -> Any:
    """Collective, under no_grad by the caller: each label token's log-probability under the reference of a
    preference or RL objective: `reference` = (its task, a frozen copy) from `task.build_reference`, or None for
    a LoRA run's policy with its adapters switched off (no second copy). `kwargs` go to `run_rows` (temperature).
    Under sequence parallelism: this rank's chunk of the rows, as the policy's `run_rows` gives it. -> the task's
    RowsRun (`log_probs`, and the `rows` as the model got them: this rank's labels)."""
    if reference is None:
        from spindle.train.lora import adapters_disabled

        with adapters_disabled(model):
            return task.run_rows(model, rows, log_probs=True, **kwargs)
    ref_task, ref_model = reference
    return ref_task.run_rows(ref_model, rows, log_probs=True, **kwargs)


def sequence_parallel_sum(value: torch.Tensor, task: Any) -> torch.Tensor:
    """Collective under sequence parallelism: a per-row sum over this rank's chunk of the tokens -> over the whole
    row (every SP rank the same), differentiable: the backward hands each rank the gradient of its own chunk, so
    the SP ranks' gradients sum to the row's as for a token loss. The value itself without SP."""
    if task.mesh.dims.sp == 1:
        return value
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(value, group=task.mesh.sp.get_group())  # type: ignore[no-any-return]
