"""Several rewards scored on one batch of samples and combined: each one's values (for its mean in the
metrics) and their weighted sum. A reward that raises, returns the wrong count or a value that is not a
finite number stops the run with one `RewardError` naming the reward and the prompt."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spindle.contracts.request import short_repr

# (outputs, prompts, columns) -> one value per sample; outputs are images/videos (DiT) or completions (LM)
Scorer = Callable[[Sequence[Any], Sequence[Any], Mapping[str, Sequence[Any]]], Sequence[Any]]


class RewardError(RuntimeError):
    """A reward failed while scoring; the message names the reward and the prompt. The CLI prints it in one
    line with the reward function's own frames (`user_code`), not Spindle's traceback."""

    user_code = True


@dataclass(frozen=True)
class Reward:
    """One loaded reward: `name` (metrics: reward/NAME), `source` (the config entry, in messages), `weight`,
    and `score`, called with the batch's outputs, prompts and extra columns."""

    name: str
    source: str
    weight: float
    score: Scorer


@dataclass(frozen=True)
class RewardScores:
    """Per reward its values ([N], float32, unweighted), and the weighted sum ([N])."""

    per_reward: dict[str, torch.Tensor]
    total: torch.Tensor

    def means(self) -> dict[str, float]:
        """The metrics: reward/NAME -> the batch mean of that reward."""
        return {f"reward/{name}": float(values.mean()) for name, values in self.per_reward.items()}


class RewardSet:
    """The rewards of a run, scored together (`__call__`)."""

    def __init__(self, rewards: Sequence[Reward]) -> None:
        if not rewards:
            raise ValueError("a RewardSet needs at least one reward")
        names = [r.name for r in rewards]
        if len(set(names)) != len(names):
            raise ValueError(f"rewards need distinct names (metrics reward/NAME); got {names}: set `name` on each")
        self.rewards = list(rewards)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]

    def __call__(
        self, outputs: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]] | None = None
    ) -> RewardScores:
        count = len(outputs)
        columns = dict(columns or {})
        if len(prompts) != count:
            raise ValueError(f"{count} samples but {len(prompts)} prompts; give one prompt per sample")
        for key, values in columns.items():
            if len(values) != count:
                raise ValueError(f"column {key!r} has {len(values)} values for {count} samples; give one per sample")
        if count == 0:
            empty = torch.zeros(0, dtype=torch.float32)
            return RewardScores({r.name: empty for r in self.rewards}, empty)
        per_reward = {r.name: self._score(r, outputs, prompts, columns) for r in self.rewards}
        total = torch.zeros(count, dtype=torch.float32)
        for r in self.rewards:
            total += r.weight * per_reward[r.name]
        return RewardScores(per_reward, total)

    @staticmethod
    def _score(
        reward: Reward, outputs: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
    ) -> torch.Tensor:
        where = f"reward {reward.name!r} ({reward.source})"
        first = f"prompt {short_repr(prompts[0])}" + (f" and {len(prompts) - 1} more" if len(prompts) > 1 else "")
        try:
            values = reward.score(outputs, prompts, columns)
        except RewardError:
            raise  # already names the reward's endpoint and what failed
        except Exception as e:
            raise RewardError(f"{where} raised {type(e).__name__}: {e} (scoring {first})") from e
        if torch.is_tensor(values):
            values = values.detach().cpu().reshape(-1).tolist()
        values = list(values)
        if len(values) != len(outputs):
            raise RewardError(
                f"{where} returned {len(values)} values for {len(outputs)} samples ({first}); return one float per sample"
            )
        out = []
        for i, value in enumerate(values):
            try:  # a number (or a 0-d array / tensor); text that happens to parse is refused too
                number = math.nan if isinstance(value, (str, bytes)) else float(value)
            except (TypeError, ValueError):
                number = math.nan
            if not math.isfinite(number):
                raise RewardError(
                    f"{where} returned {short_repr(value)} for prompt {short_repr(prompts[i])} (sample {i}); "
                    "every reward must be a finite number"
                )
            out.append(number)
        return torch.tensor(out, dtype=torch.float32)
