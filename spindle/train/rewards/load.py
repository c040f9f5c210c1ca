"""`rewards:` entries -> a `RewardSet`, everything resolved before any training (files imported, folders
loaded), with the calling convention of the model kind:

- DiT models (`kind="dit"`): `fn(images, prompts, **columns) -> list[float]`, images float32 numpy arrays
  [H, W, 3] in [0, 1] (videos [F, H, W, 3]);
- language models (`kind="lm"`, TRL's convention): `fn(prompts, completions, **columns) -> list[float]`.

Functions are called by keyword, as TRL calls them, with the arguments they take: `def f(completions,
**kwargs)` and `def f(images, prompts, colour)` both work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from spindle.config import ConfigError, RewardKind, RewardSpec, check_reward_kind
from spindle.train.rewards.combine import Reward, RewardSet, Scorer
from spindle.train.rewards.functions import accepts, check_takes, load_function


def load_rewards(
    rewards: Sequence[RewardSpec], kind: RewardKind, where: str, device: torch.device | None = None
) -> RewardSet:
    """The rewards of a run (`where`: the section's name in messages, "flow_grpo"); `device` runs the
    model-backed ones (CLIP, reward models; default CPU)."""
    try:
        check_reward_kind(list(rewards), kind, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    device = device or torch.device("cpu")
    loaded = [load_reward(r, kind, device) for r in rewards]
    names = [r.name for r in loaded]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ConfigError(
            f"{where}.rewards: two rewards are named {doubled[0]!r} (metrics reward/NAME); give each a distinct `name`"
        )
    return RewardSet(loaded)


def load_reward(cfg: RewardSpec, kind: RewardKind, device: torch.device) -> Reward:
    score: Scorer
    if cfg.fn is not None:
        score = function_scorer(load_function(cfg.fn), kind, cfg.fn)
        default = cfg.fn.rpartition(":")[2]
    elif cfg.url is not None:
        from spindle.train.rewards.http_scorer import HttpScorer

        score = HttpScorer(cfg, kind)
        default = urlparse(cfg.url).netloc or cfg.url
    elif cfg.model is not None:
        from spindle.train.rewards.reward_model import RewardModel

        score = RewardModel(cfg.model, cfg.batch_size, device)
        default = Path(cfg.model).name
    else:
        from spindle.train.rewards.builtin import ClipScore, jpeg_compressibility, jpeg_incompressibility

        if cfg.builtin == "clip_score":
            assert cfg.clip_model is not None  # the config requires it with clip_score
            score = ClipScore(cfg.clip_model, cfg.batch_size, device)
        else:
            score = {"jpeg_compressibility": jpeg_compressibility, "jpeg_incompressibility": jpeg_incompressibility}[
                str(cfg.builtin)
            ]
        default = str(cfg.builtin)
    return Reward(name=cfg.name or default, source=cfg.source, weight=cfg.weight, score=score)


CONVENTIONS: dict[str, tuple[str, str, str]] = {
    # kind: (keyword of the samples, keyword of the prompts, the convention in messages)
    "dit": ("images", "prompts", "fn(images=..., prompts=..., **columns)"),
    "lm": ("completions", "prompts", "fn(prompts=..., completions=..., **columns) (TRL's)"),
}


def function_scorer(fn: Callable[..., Any], kind: RewardKind, spec: str) -> Scorer:
    """A user's function called in the kind's convention, by keyword as TRL calls reward functions, with the
    arguments and extra columns it takes (checked before training: it must take the samples)."""
    samples, prompts_key, convention = CONVENTIONS[kind]
    check_takes(fn, spec, samples, convention)

    def score(outputs: Sequence[Any], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]) -> Any:
        reserved = {samples, prompts_key} & set(columns)
        if reserved:
            raise ValueError(f"a column may not be named {sorted(reserved)[0]!r}: rewards get that argument already")
        given = {samples: list(outputs), prompts_key: list(prompts), **columns}
        return fn(**{k: given[k] for k in accepts(fn, set(given))})

    return score
