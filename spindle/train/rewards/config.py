"""The `rewards:` entries of a post-training section (`flow_grpo.rewards`, `grpo.rewards`), shared by every
objective that scores samples.

An entry is a mapping (`{fn: "rewards.py:brightness", weight: 1.0}`) or a string, read as:
`http://...` / `https://...` an HTTP scorer; `builtin:NAME` a built-in; `path/to/file.py:function` or
`module:function` a function; anything else (no colon) a reward-model folder. Weights come from each entry's
`weight` or from the section's `reward_weights` list (one per entry), not both.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_validator

from spindle.config import Section

Builtin = Literal["jpeg_compressibility", "jpeg_incompressibility", "clip_score"]
Kind = Literal["dit", "lm"]  # what the rewards score: decoded images/videos, or text completions
SOURCES = ("fn", "model", "url", "builtin")
HTTP_FIELDS = ("timeout_s", "retries", "backoff_s", "concurrency")


class RewardConfig(Section):
    """One reward: exactly one of `fn`, `model`, `url`, `builtin`, and its weight."""

    fn: str | None = Field(
        None,
        description="a Python function, `path/to/file.py:function` (relative to the working directory) or "
        "`module:function`: fn(images, prompts, **columns) for DiT models, fn(prompts, completions, **columns) "
        "for language models, returning one float per sample",
    )
    model: str | None = Field(
        None,
        description="language models: a reward-model folder (transformers AutoModelForSequenceClassification, "
        "num_labels 1) scoring prompt + completion",
    )
    url: str | None = Field(
        None,
        description="an HTTP scorer: POST of JSON {prompts, images (base64 PNGs; a video: a list of frames) or "
        "completions, columns}, answering {scores: [one float per sample]}",
    )
    builtin: Builtin | None = Field(
        None,
        description="DiT models: jpeg_compressibility (minus the JPEG size in kB, DDPO's), jpeg_incompressibility "
        "(the size), clip_score (prompt-image cosine similarity of a local CLIP, `clip_model`)",
    )
    clip_model: str | None = Field(None, description="builtin clip_score: a local transformers CLIP folder")
    weight: float = Field(1.0, description="the reward's weight in the summed reward (the per-reward means are logged)")
    name: str | None = Field(
        None, description="the name in metrics (reward/NAME); default: the function's, built-in's or folder's name"
    )
    batch_size: int = Field(
        8, ge=1, description="samples per call of a model (reward model, CLIP) or per request (HTTP scorer)"
    )
    timeout_s: float = Field(60.0, gt=0, description="HTTP scorer: seconds to wait for one answer")
    retries: int = Field(3, ge=0, description="HTTP scorer: tries after a failed one (connection error, timeout, 5xx)")
    backoff_s: float = Field(1.0, ge=0, description="HTTP scorer: wait before the first retry, doubled after each")
    concurrency: int = Field(4, ge=1, description="HTTP scorer: requests in flight at once")

    @model_validator(mode="after")
    def _one_source(self) -> RewardConfig:
        given = [k for k in SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a reward needs exactly one of {', '.join(SOURCES)}; got {', '.join(given) if given else 'none'} "
                "(e.g. {fn: rewards.py:brightness} or {builtin: jpeg_compressibility})"
            )
        if (self.builtin == "clip_score") != (self.clip_model is not None):
            raise ValueError(
                "builtin clip_score needs clip_model: a local transformers CLIP folder"
                if self.builtin == "clip_score"
                else "clip_model is the folder of builtin clip_score; remove it or set builtin: clip_score"
            )
        stray = [k for k in HTTP_FIELDS if k in self.model_fields_set] if self.url is None else []
        if stray:
            raise ValueError(f"{', '.join(stray)} configure an HTTP scorer (url); this reward has none")
        return self

    @property
    def source(self) -> str:
        """The entry as a user reads it in messages: the spec string."""
        return next(f"{k}: {getattr(self, k)}" for k in SOURCES if getattr(self, k) is not None)


def parse_reward(value: Any) -> Any:
    """A string entry as the mapping it stands for (other values as they are, for pydantic to check)."""
    if not isinstance(value, str):
        return value
    if value.startswith(("http://", "https://")):
        return {"url": value}
    if value.startswith("builtin:"):
        return {"builtin": value.removeprefix("builtin:")}
    if ":" in value:
        return {"fn": value}
    return {"model": value}


def _entries(value: Any) -> Any:
    return [parse_reward(v) for v in value] if isinstance(value, list) else value


RewardList = Annotated[list[RewardConfig], BeforeValidator(_entries)]


def weighted_rewards(rewards: list[RewardConfig], weights: list[float] | None, where: str) -> list[RewardConfig]:
    """`rewards` with the section's `reward_weights` applied (checked: one per reward, and no reward
    weighted twice); `where` is the section's name in messages ("flow_grpo")."""
    if not rewards:
        raise ValueError(f"{where}.rewards is empty; give at least one reward (e.g. [rewards.py:brightness])")
    if weights is None:
        return rewards
    if len(weights) != len(rewards):
        raise ValueError(
            f"{where}.reward_weights has {len(weights)} entries for {len(rewards)} rewards; give one weight per reward"
        )
    both = [i for i, r in enumerate(rewards) if "weight" in r.model_fields_set]
    if both:
        raise ValueError(
            f"{where}.rewards[{both[0]}] sets its own weight and {where}.reward_weights gives one too; keep one of them"
        )
    return [r.model_copy(update={"weight": w}) for r, w in zip(rewards, weights, strict=True)]


def check_kind(rewards: list[RewardConfig], kind: Kind, where: str) -> None:
    """Refuse a reward the model kind cannot produce inputs for, naming the entry."""
    for i, r in enumerate(rewards):
        if kind == "dit" and r.model is not None:
            raise ValueError(
                f"{where}.rewards[{i}] ({r.source}) is a reward-model folder, which scores text (language models); "
                "a DiT model's rewards are functions, HTTP scorers or built-ins (a string without ':' reads as a "
                "folder: write path/to/file.py:function for a function)"
            )
        if kind == "lm" and r.builtin is not None:
            raise ValueError(
                f"{where}.rewards[{i}] (builtin: {r.builtin}) scores images; a language model's rewards are "
                "functions, reward-model folders or HTTP scorers"
            )
