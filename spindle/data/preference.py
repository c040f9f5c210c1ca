"""Preference pairs and prompts in TRL's dataset formats -> token ids, tokenised as TRL 1.16 does it.

Preference lines (DPO, reward models), one JSON object per line of a `.jsonl` file (or of every `.jsonl` under a
folder, in sorted path order):

- standard: `{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}`;
- conversational: the same keys holding message lists (`[{"role": "user", "content": "..."}]`), rendered by the
  tokenizer's chat template;
- implicit prompt: only `"chosen"` and `"rejected"`, two whole texts or conversations; the prompt is their
  shared beginning, split off as `trl.extract_prompt` does (the longest run of equal characters or messages;
  for text, a space just before the first difference goes to the completions);
- an optional `"margin"` number (reward models: the Bradley-Terry loss wants chosen to beat rejected by it): on
  every line or on none. Other keys are ignored.

Tokenisation (`trl.DPOTrainer._prepare_dataset`): a text completion gets the tokenizer's EOS text appended
(unless it already ends with it); a conversation's turns end as its template ends them. The prompt and the
prompt followed by each completion are tokenised (text: `tokenizer(text)` with its special tokens;
conversations: `apply_chat_template(..., tokenize=True)`, the prompt with the generation prompt), and the
completions start where those token lists stop agreeing (usually right after the prompt; a template that
renders the prompt alone differently, or tokens that merge across the boundary, move the split earlier).
So `prompt_ids + chosen_ids` is exactly the tokenised prompt-and-chosen text, which is also what a reward
model scores (`trl.RewardTrainer` tokenises the whole text).

Truncation, in this order:

1. `max_prompt_length` (`dpo.max_prompt_length`; none by default): a longer prompt keeps its last
   `max_prompt_length` tokens (the end is what the completion follows). TRL 1.16 has no such option.
2. `seq_len` (`data.seq_len`): prompt + completion is cut to its first `seq_len` tokens (TRL's
   `max_length` with `truncation_mode="keep_start"`); a pair whose prompt alone fills `seq_len` has nothing
   left to learn and is dropped (as TRL drops it); both counts are in the stats and logged.
   For reward models (`reward_pairs`) a sequence cannot be cut (the score is read at its last token): a pair
   with a sequence over `seq_len` is dropped and counted, as `trl.RewardTrainer` filters it.

A line that cannot be used (not JSON, a missing or empty field, a prompt in one format and completions in
another, a margin that is not a number, a message whose content is a list of parts for a text model: images,
videos and audio need a vision-language family's processor, spindle.data.media_preference) is a
`PreferenceDataError` naming `file:line` before any model is built. Pairs whose chosen equals rejected are
kept, as TRL keeps them (in sigmoid DPO each adds log 2 to the loss and nothing to the gradient), but counted,
and the first few are named in the log.

Prompt-only lines (GRPO): `{"prompt": "..."}` or `{"prompt": [messages]}`; every other key is kept and handed
to reward functions as keyword arguments (TRL's convention; `completion` / `completion_ids` are TRL's own
names and are refused). Prompts are tokenised as `GRPOTrainer._tokenize_prompts` does (the chat template
with the generation prompt, or `tokenizer(text)`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spindle.data.text import IGNORE_INDEX, json_line, jsonl_files

log = logging.getLogger("spindle.data")

Completion = str | list[dict[str, Any]]
# Keys TRL's GRPO does not hand to reward functions (it passes its own prompts and completions).
RESERVED_PROMPT_COLUMNS = ("completion", "completion_ids")
SHOWN_IDENTICAL = 5  # pairs with chosen == rejected named in the log


class PreferenceDataError(ValueError):
    """A data file or line the user must fix; the message names file:line and what is wrong."""


@dataclass
class PreferencePair:
    """One tokenised pair: the prompt's ids, and each completion's ids (what follows the prompt)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str  # "file:line"
    margin: float | None = None
    # a vision-language pair's prompt media (images, videos, audio) in token order (spindle.data.media_preference)
    media: list[Any] = field(default_factory=list)


@dataclass
class PreferenceStats:
    pairs: int  # pairs kept
    identical: int  # pairs whose chosen equals rejected (kept)
    prompt_truncated: int  # prompts cut to max_prompt_length
    truncated: int  # pairs with a sequence cut to seq_len
    dropped: int  # pairs dropped: prompt fills seq_len (DPO) or a sequence over seq_len (reward)


@dataclass
class PromptExample:
    """One GRPO prompt: as written (text or messages), its token ids, and the line's other columns."""

    prompt: Completion
    prompt_ids: list[int]
    source: str
    columns: dict[str, Any] = field(default_factory=dict)
    media: list[Any] = field(default_factory=list)  # a vision-language prompt's images/videos/audio, in token order


# ---------------------------------------------------------------- reading lines


def _lines(path: str | Path) -> list[tuple[str, Any]]:
    """(`file:line`, JSON value) for every line of the JSONL file(s) at `path`; a bad line raises."""
    return [(where, obj) for where, _, obj in _file_lines(path)]


def _file_lines(path: str | Path) -> list[tuple[str, Path, Any]]:
    """(`file:line`, the file, JSON value) for every line of the JSONL file(s) at `path`; a bad line raises."""
    out = []
    for file in jsonl_files(path):
        with file.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                where = f"{file}:{number}"
                try:
                    out.append((where, file, json_line(raw)))
                except ValueError as e:
                    raise PreferenceDataError(f"{where}: {e}") from None
    return out


def is_conversation(value: Any) -> bool:
    """A message list, as `trl.data_utils.is_conversational` tells one: a list whose first item has a role."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _check_value(name: str, value: Any) -> None:
    """`value` is a non-empty string or a non-empty, well-formed message list."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f'"{name}" is empty')
        return
    if not isinstance(value, list):
        raise ValueError(f'"{name}" must be a string or a list of {{"role", "content"}} messages, got {value!r}')
    if not value:
        raise ValueError(f'"{name}" is an empty message list')
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f'{name}[{i}] must be an object with a string "role" and a "content", got {m!r}')
        content = m["content"]
        if not isinstance(content, (str, list)):
            raise ValueError(f"{name}[{i}].content must be a string or a list of content parts, got {content!r}")


def extract_prompt(chosen: Completion, rejected: Completion) -> tuple[Completion, Completion, Completion]:
    """The implicit prompt: the shared beginning of chosen and rejected, split off as `trl.extract_prompt`
    does it (kept identical on purpose, including its two quirks: a space just before the first difference
    goes to the completions, and when one is a prefix of the other the split is one item before its end)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # idx is read after the loop, as in TRL
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def preference_example(obj: Any) -> dict[str, Any]:
    """A preference line's JSON -> {"prompt", "chosen", "rejected", "margin"} (the prompt split off when implicit);
    ValueError naming the field that is wrong."""
    if not isinstance(obj, dict):
        raise ValueError('each line must be an object with "chosen" and "rejected" (and usually "prompt")')
    for name in ("chosen", "rejected"):
        if name not in obj:
            raise ValueError(f'missing "{name}" (each line needs "chosen" and "rejected"; "prompt" is optional)')
        _check_value(name, obj[name])
    chosen, rejected = obj["chosen"], obj["rejected"]
    if is_conversation(chosen) != is_conversation(rejected):
        raise ValueError('"chosen" and "rejected" must both be strings or both be message lists')
    if "prompt" in obj:
        prompt = obj["prompt"]
        _check_value("prompt", prompt)
        if is_conversation(prompt) != is_conversation(chosen):
            raise ValueError('"prompt" and the completions must all be strings or all be message lists')
    else:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not prompt:
            raise ValueError(
                '"chosen" and "rejected" share no beginning, so there is no implicit prompt; give a "prompt"'
            )
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if not value or (isinstance(value, str) and not value.strip()):
                raise ValueError(
                    f'"{name}" is empty once the prompt shared with the other completion is removed; '
                    'give a "prompt" and the two completions apart'
                )
    margin = obj.get("margin")
    if margin is not None and (
        isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin)
    ):
        raise ValueError(f'"margin" must be a finite number, got {margin!r}')
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin}


# ---------------------------------------------------------------- tokenising


def _tokenize(tokenizer: Any, value: Completion, generation_prompt: bool = False) -> list[int]:
    """`trl.data_utils._tokenize` for a text tokenizer: the chat template for messages, `tokenizer(text)` else."""
    if isinstance(value, list):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template, so message lists cannot be rendered; use strings")
        parts = next((i for i, m in enumerate(value) if not isinstance(m["content"], str)), None)
        if parts is not None:
            # a text template would print the list's Python repr: refuse rather than train on it
            raise ValueError(
                f"message {parts} has a list of content parts; a text model's chat template renders string "
                "content only (images, videos and audio in preference data need a vision-language family)"
            )
        kwargs = {"add_generation_prompt": True} if generation_prompt else {}
        out = tokenizer.apply_chat_template(value, tokenize=True, return_dict=True, **kwargs)
        return list(out["input_ids"])
    return list(tokenizer(text=value)["input_ids"])


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def tokenize_preference(example: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) of one example, as `trl.DPOTrainer` tokenises it (module doc)."""
    prompt, chosen, rejected = example["prompt"], example["chosen"], example["rejected"]
    if isinstance(chosen, str):
        eos = tokenizer.eos_token
        if eos is None:
            raise ValueError("the tokenizer has no eos_token; set eos_token in the model's tokenizer_config.json")
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
    prompt_ids = _tokenize(tokenizer, prompt, generation_prompt=True)
    prompt_chosen = _tokenize(tokenizer, prompt + chosen)
    prompt_rejected = _tokenize(tokenizer, prompt + rejected)
    split = min(common_prefix_length(prompt_ids, prompt_chosen), common_prefix_length(prompt_ids, prompt_rejected))
    return prompt_ids[:split], prompt_chosen[split:], prompt_rejected[split:]


def _identical(example: dict[str, Any]) -> bool:
    return bool(example["chosen"] == example["rejected"])


# (example, its file) -> (prompt_ids, chosen_ids, rejected_ids, the prompt's media): how a model kind tokenises
PairTokenizer = Callable[[dict[str, Any], Path], tuple[list[int], list[int], list[int], list[Any]]]


def text_pair_tokenizer(tokenizer: Any) -> PairTokenizer:
    """A text model's: `tokenize_preference`, no media."""

    def tokenize(example: dict[str, Any], file: Path) -> tuple[list[int], list[int], list[int], list[Any]]:
        return (*tokenize_preference(example, tokenizer), [])

    return tokenize


def _read_pairs(path: str | Path, tokenize: PairTokenizer) -> tuple[list[PreferencePair], int, list[str]]:
    """Every line tokenised, untruncated; -> (pairs, identical count, identical sources)."""
    pairs: list[PreferencePair] = []
    identical: list[str] = []
    with_margin: str | None = None
    without_margin: str | None = None
    for where, file, obj in _file_lines(path):
        try:
            example = preference_example(obj)
            prompt_ids, chosen_ids, rejected_ids, media = tokenize(example, file)
        except ValueError as e:
            raise PreferenceDataError(f"{where}: {e}") from None
        if not chosen_ids or not rejected_ids:
            raise PreferenceDataError(
                f"{where}: a completion has no tokens of its own once tokenised after the prompt; "
                "check the chat template renders the completion"
            )
        if example["margin"] is None:
            without_margin = without_margin or where
        else:
            with_margin = with_margin or where
        if with_margin and without_margin:
            raise PreferenceDataError(
                f'{without_margin}: no "margin", but {with_margin} has one; give "margin" on every line or on none'
            )
        if _identical(example):
            identical.append(where)
        margin = None if example["margin"] is None else float(example["margin"])
        pairs.append(PreferencePair(prompt_ids, chosen_ids, rejected_ids, where, margin, media))
    if not pairs:
        raise PreferenceDataError(f"data.path {path} has no preference pairs")
    return pairs, len(identical), identical


def _report(path: str | Path, stats: PreferenceStats, identical: list[str], limit: str) -> None:
    if stats.identical:
        shown = ", ".join(identical[:SHOWN_IDENTICAL]) + (" ..." if stats.identical > SHOWN_IDENTICAL else "")
        log.warning(
            "%s: %d of %d pairs have chosen == rejected (no preference to learn; kept, as TRL keeps them): %s",
            path,
            stats.identical,
            stats.pairs + stats.dropped,
            shown,
        )
    if stats.prompt_truncated:
        log.warning("%s: %d prompts cut to their last max_prompt_length tokens", path, stats.prompt_truncated)
    if stats.truncated:
        log.warning("%s: %d pairs cut to data.seq_len tokens", path, stats.truncated)
    if stats.dropped:
        log.warning("%s: %d pairs dropped: %s (raise data.seq_len to keep them)", path, stats.dropped, limit)


def preference_pairs(
    path: str | Path,
    tokenizer: Any,
    seq_len: int,
    max_prompt_length: int | None = None,
    tokenize: PairTokenizer | None = None,
    media_ids: set[int] | frozenset[int] = frozenset(),
) -> tuple[list[PreferencePair], PreferenceStats]:
    """The DPO pairs of the JSONL file(s) at `path`, tokenised and truncated (module doc). `tokenize`: a model
    kind's tokenisation (default: text, `tokenizer`'s); `media_ids`: its media placeholder tokens, which a
    prompt may not lose to max_prompt_length."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    raw, identical, identical_at = _read_pairs(path, tokenize or text_pair_tokenizer(tokenizer))
    pairs: list[PreferencePair] = []
    prompt_truncated = truncated = dropped = 0
    for pair in raw:
        prompt = pair.prompt_ids
        if max_prompt_length is not None and len(prompt) > max_prompt_length:
            if any(t in media_ids for t in prompt[:-max_prompt_length]):
                raise PreferenceDataError(
                    f"{pair.source}: the prompt is {len(prompt)} tokens; cutting it to dpo.max_prompt_length="
                    f"{max_prompt_length} would cut image/video/audio tokens: raise dpo.max_prompt_length or lower "
                    "data.max_pixels / data.max_frames"
                )
            prompt = prompt[-max_prompt_length:]
            prompt_truncated += 1
        if len(prompt) >= seq_len:
            dropped += 1
            continue
        room = seq_len - len(prompt)
        if len(pair.chosen_ids) > room or len(pair.rejected_ids) > room:
            truncated += 1
        chosen, rejected = pair.chosen_ids[:room], pair.rejected_ids[:room]
        pairs.append(PreferencePair(prompt, chosen, rejected, pair.source, pair.margin, pair.media))
    stats = PreferenceStats(len(pairs), identical, prompt_truncated, truncated, dropped)
    _report(path, stats, identical_at, "the prompt alone fills data.seq_len")
    if not pairs:
        raise PreferenceDataError(
            f"data.path {path}: every pair's prompt fills data.seq_len={seq_len}; raise data.seq_len or set "
            "dpo.max_prompt_length"
        )
    return pairs, stats


def reward_pairs(
    path: str | Path, tokenizer: Any, seq_len: int, tokenize: PairTokenizer | None = None
) -> tuple[list[PreferencePair], PreferenceStats]:
    """The reward-model pairs of the JSONL file(s) at `path`: whole sequences (`prompt_ids + chosen_ids`, the
    tokenised prompt-and-completion text), never cut; a pair with one over `seq_len` is dropped (module doc).
    `tokenize`: a model kind's tokenisation (default: text, `tokenizer`'s; a vision-language model's keeps the
    prompt's media, spindle.data.media_preference)."""
    raw, identical, identical_at = _read_pairs(path, tokenize or text_pair_tokenizer(tokenizer))
    pairs = [p for p in raw if len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)) <= seq_len]
    stats = PreferenceStats(len(pairs), identical, 0, 0, len(raw) - len(pairs))
    _report(path, stats, identical_at, "a sequence is longer than data.seq_len")
    if not pairs:
        raise PreferenceDataError(f"data.path {path}: every pair is longer than data.seq_len={seq_len}")
    return pairs, stats


# ---------------------------------------------------------------- batches


def collate_sequences(
    rows: list[tuple[list[int], list[int]]], pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """(prompt ids, completion ids) rows -> a right-padded batch whose completion tokens are the scored ones,
    its length rounded up to a `multiple` (sequence parallelism: each SP rank an equal chunk).

    -> input_ids, attention_mask (1 on tokens), completion_mask (1 on completion tokens): [N, L]; shift_labels
    [N, L] (the token each position predicts where that token is a completion token, else -100: what
    `spindle.train.objectives.logprobs` scores); position_ids [N, L].
    """
    width = max(len(prompt) + len(completion) for prompt, completion in rows)
    width = -(-width // multiple) * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion, dtype=torch.long)
        attention[i, :n] = 1
        completion_mask[i, len(prompt) : n] = 1
    labels = ids.masked_fill(completion_mask == 0, IGNORE_INDEX)
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "completion_mask": completion_mask,
        "shift_labels": torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX),
        "position_ids": torch.arange(width).expand(len(rows), width).clone(),
    }


def collate_rows(
    rows: list[tuple[list[int], list[int], list[Any]]], pad_id: int, multiple: int = 1
) -> dict[str, torch.Tensor]:
    """(prompt ids, completion ids, media) rows of a text model (no media) -> `collate_sequences`'s batch."""
    return collate_sequences([(prompt, completion) for prompt, completion, _ in rows], pad_id, multiple)


def collate_pairs(pairs: list[PreferencePair], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """A batch in `trl.DPOTrainer`'s layout: the B chosen sequences, then the B rejected ones, right-padded
    (`collate_sequences`'s tensors, [2B, L], L a `multiple`), plus margin [B] when the pairs have one."""
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    out = collate_sequences(rows, pad_id, multiple)
    if pairs[0].margin is not None:
        out["margin"] = torch.tensor([p.margin for p in pairs], dtype=torch.float32)
    return out


def collate_reward_pairs(pairs: list[PreferencePair], pad_id: int, multiple: int = 1) -> dict[str, torch.Tensor]:
    """A batch in `trl.RewardTrainer`'s layout: B chosen then B rejected whole sequences, right-padded (L a
    `multiple`). -> input_ids, attention_mask [2B, L], last_index [2B] (the position whose score is the
    sequence's), margin [B] when the pairs have one."""
    batch = collate_pairs(pairs, pad_id, multiple)
    out = {k: batch[k] for k in ("input_ids", "attention_mask")}
    out["last_index"] = batch["attention_mask"].sum(dim=1) - 1
    if "margin" in batch:
        out["margin"] = batch["margin"]
    return out


# ---------------------------------------------------------------- prompts (GRPO)


def prompt_example(obj: Any) -> tuple[Completion, dict[str, Any]]:
    """A prompt line's JSON -> (prompt, the other columns); ValueError naming what is wrong."""
    if not isinstance(obj, dict) or "prompt" not in obj:
        raise ValueError('each line must be an object with a "prompt" (a string or a list of messages)')
    _check_value("prompt", obj["prompt"])
    reserved = [k for k in RESERVED_PROMPT_COLUMNS if k in obj]
    if reserved:
        raise ValueError(
            f"column {reserved[0]!r} is the name reward functions get the generated completions under; rename it"
        )
    return obj["prompt"], {k: v for k, v in obj.items() if k != "prompt"}


# (prompt, its file) -> (prompt_ids with the generation prompt, its media): how a model kind tokenises a prompt
PromptTokenizer = Callable[[Completion, Path], tuple[list[int], list[Any]]]


def read_prompts(
    path: str | Path,
    tokenizer: Any,
    max_prompt_length: int | None = None,
    tokenize: PromptTokenizer | None = None,
    media_ids: set[int] | frozenset[int] = frozenset(),
) -> list[PromptExample]:
    """The GRPO prompts of the JSONL file(s) at `path`, tokenised as `trl.GRPOTrainer` does (`tokenize`: a model
    kind's way, with media; default the text tokenizer's); a prompt longer than `max_prompt_length` keeps its
    last tokens (logged), unless that would cut media tokens (`media_ids`: refused, naming the line)."""
    out: list[PromptExample] = []
    cut = 0
    for where, file, obj in _file_lines(path):
        try:
            prompt, columns = prompt_example(obj)
            ids, media = (
                tokenize(prompt, file) if tokenize else (_tokenize(tokenizer, prompt, generation_prompt=True), [])
            )
        except ValueError as e:
            raise PreferenceDataError(f"{where}: {e}") from None
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if any(t in media_ids for t in ids[:-max_prompt_length]):
                raise PreferenceDataError(
                    f"{where}: the prompt is {len(ids)} tokens; cutting it to grpo.max_prompt_length="
                    f"{max_prompt_length} would cut image/video/audio tokens: raise grpo.max_prompt_length"
                )
            ids = ids[-max_prompt_length:]
            cut += 1
        out.append(PromptExample(prompt, ids, where, columns, media))
    if not out:
        raise PreferenceDataError(f"data.path {path} has no prompts")
    if cut:
        log.warning("%s: %d prompts cut to their last %s tokens", path, cut, max_prompt_length)
    return out
