"""`train.objective: sft` (language models, the default): next-token cross-entropy on the documents' label
tokens. The task's input kind builds the rows (text/chat JSONL packed into rows; image/video/audio
conversations) and runs them through the model, asking its own loss path for the *sum* over valid tokens;
the trainer divides by the valid-token count of the global batch (`loss_units`), so the step loss is the mean
over every valid token of the global batch, whatever the micro-batch / data-parallel / SP split."""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.task import Objective, StepOutput

IGNORE_INDEX = -100


class SFT(Objective):
    name = "sft"

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def build_loader(self, task: Any) -> Any:
        return task.document_loader()

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())  # the whole rows, before any SP split

    def forward(self, task: Any, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepOutput:
        run = task.run_rows(model, batch)
        return StepOutput(run.out.loss.float(), run.samples, run.tokens, task.output_metrics(run.out, run.rows))
