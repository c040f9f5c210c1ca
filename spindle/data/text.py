"""Text and chat JSONL -> token rows for causal-LM training: tokenize, mask, pack.

Each line of a `.jsonl` file (or of every `.jsonl` under a folder, in sorted path order) is a document:

- `{"text": "..."}`: `tokenizer(text)` (with the tokenizer's own special-token rules) followed by the
  EOS token; every token is learned.
- `{"messages": [{"role": ..., "content": ...}, ...]}`: the tokenizer's chat template; only the
  assistant turns are learned. Assistant spans are found by rendering the conversation up to each
  assistant turn (with the generation prompt) and up to its end, so any template works, with or
  without `{% generation %}` markers. A message the template does not render (a role it does not
  know: Qwen's template renders user/system/assistant/tool and silently drops anything else) is an
  error naming `file:line` and the template's roles; a template that prints any role accepts any.

Lines are UTF-8; a line that is not is reported as `file:line` like any bad line, and skipped
with `data.skip_bad_samples: true`.

Rows (`seq_len` tokens each; a micro-batch is cut to its longest row, `trim_padding`) carry `input_ids`,
`position_ids`, `shift_labels` and `attention_mask` (1 = a document's token, 0 = padding): labels already
shifted (position t holds the token to predict at t), -100 where nothing is learned, including the
last token of every document, so no position predicts across a document boundary. With packing,
documents are laid end to end in file order, a document that does not fit the rest of a row starts
the next row, and positions restart at 0 per document: attention reads the documents from such
position ids (Spindle's varlen attention, spindle/ops/varlen_attention.py, per document without a
mask; with `model.attn_implementation: sdpa`, transformers' block-diagonal causal mask from
`masking_utils.find_packed_sequence_indices`, when no attention mask and no cache is passed), so
attention never crosses documents either. Padding continues the
positions of the row's last document (it only follows real tokens, so causal attention keeps it
out of them) and is never learned. `attention_mask` is not given to attention (it would hide the
packed documents from transformers, and causal attention already keeps padding out of real tokens):
it keeps padding out of per-token statistics, e.g. the MoE router's aux loss and expert load.
Everything is a pure function of the files, the tokenizer and `seq_len`: every rank and every resume
builds the same rows.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100
log = logging.getLogger("spindle.data")


class TextDataError(ValueError):
    """A data file or line the user must fix; the message names file:line and what is wrong."""


@dataclass
class Document:
    tokens: list[int]
    learn: list[bool]  # learn[t]: token t is a training target (predicted from the tokens before it)
    source: str  # "file:line"


@dataclass
class PackStats:
    documents: int
    rows: int
    truncated: int  # documents longer than seq_len, cut to seq_len
    skipped: int  # bad lines skipped (data.skip_bad_samples)
    label_tokens: int  # tokens with a label over all rows


# ---------------------------------------------------------------- reading


def jsonl_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.jsonl") if p.is_file())
        if files:
            return files
        raise TextDataError(f"data.path {path} holds no .jsonl files; put text/chat JSONL files there")
    raise TextDataError(f"data.path {path} does not exist (expected a .jsonl file or a folder of them)")


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def text_document(text: Any, tokenizer: Any) -> tuple[list[int], list[bool]]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError('"text" must be a non-empty string')
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token; set eos_token in the model's tokenizer_config.json")
    tokens = [*_encode(tokenizer, text, special=True), tokenizer.eos_token_id]
    return tokens, [True] * len(tokens)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'messages[{i}] must be an object with string "role" and "content", got {m!r}')
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError('"messages" has no assistant turn: there is nothing to learn')


# `message.role == "user"`, `message['role'] != 'tool'`, `"system" == message.role`, `role in ["a", "b"]`
_ROLE_TEST = re.compile(r"""role(?:['"]\])?\s*[!=]=\s*['"]([^'"]+)['"]""")
_ROLE_TEST_REVERSED = re.compile(r"""['"]([^'"]+)['"]\s*[!=]=\s*[\w.]*(?:\[['"])?role\b""")
_ROLE_IN = re.compile(r"""role(?:['"]\])?\s+in\s+[\[(]([^\])]*)[\])]""")


@functools.lru_cache(maxsize=8)
def template_roles(template: str) -> frozenset[str]:
    """The roles a chat template tests for; empty when it tests none (it renders any role as given)."""
    roles = set(_ROLE_TEST.findall(template)) | set(_ROLE_TEST_REVERSED.findall(template))
    for group in _ROLE_IN.findall(template):
        roles |= set(re.findall(r"""['"]([^'"]+)['"]""", group))
    return frozenset(roles)


def _check_roles(messages: list[dict], tokenizer: Any) -> None:
    """Every message reaches the rendered text: the conversation is rendered once with each content
    replaced by a marker, so a role the template skips is caught whatever the template looks like."""
    probe = [{**m, "content": f"SPINDLEPROBE{i}Q"} for i, m in enumerate(messages)]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
    for i, m in enumerate(messages):
        if f"SPINDLEPROBE{i}Q" not in text:
            template = tokenizer.chat_template
            source = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
            known = ", ".join(sorted(template_roles(source))) or "?"
            raise ValueError(
                f"messages[{i}] has role {m['role']!r}, which the tokenizer's chat template does not render "
                f"(its content would be dropped); use one of the template's roles: {known}"
            )


def chat_document(messages: Any, tokenizer: Any) -> tuple[list[int], list[bool]]:
    """Chat template tokens, learned only inside assistant turns (prefix rendering, see the module doc)."""
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError('the tokenizer has no chat_template, so chat lines cannot be rendered; use {"text"} lines')
    _check_roles(messages, tokenizer)

    def render(msgs: list[dict], generation_prompt: bool) -> list[int]:
        if not msgs and generation_prompt is False:
            return []
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        return _encode(tokenizer, text, special=False)  # templates write their own special tokens

    return learn_assistant_turns(messages, render)


def learn_assistant_turns(
    messages: list[dict], render: Callable[[list[dict], bool], list[int]]
) -> tuple[list[int], list[bool]]:
    """The conversation's tokens, learned only inside assistant turns. `render(prefix, generation_prompt)`
    tokenizes a prefix of the conversation; each assistant turn spans from the prefix before it rendered
    with the generation prompt to the prefix that ends with it (see the module doc)."""
    tokens = render(messages, False)
    learn = [False] * len(tokens)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        upto = render(messages[: i + 1], False)
        if upto != tokens[: len(upto)] or start > len(upto):
            raise ValueError(
                "the chat template does not render a conversation's prefix as a prefix of the whole conversation, "
                "so assistant turns cannot be located"
            )
        learn[start : len(upto)] = [True] * (len(upto) - start)
    return tokens, learn


def decode_line(raw: bytes | str) -> str:
    """A JSONL line read as bytes -> text; a line that is not UTF-8 is a ValueError naming the byte (the
    caller names `file:line`), so one bad byte is one bad line under data.skip_bad_samples, not a crash."""
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not UTF-8 (byte 0x{e.object[e.start]:02x} at byte {e.start + 1}); re-save the file as UTF-8"
        ) from None


def json_line(raw: bytes | str) -> Any:
    """One JSONL line -> its JSON value; ValueError saying what is wrong (not UTF-8, empty, not JSON)."""
    line = decode_line(raw)
    if not line.strip():
        raise ValueError("empty line")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None


def bad_lines_message(path: Any, errors: list[str], shown: int = 20) -> str:
    """One error for a JSONL file's bad lines (each `file:line: what is wrong`): the first `shown`, and a count of
    the rest."""
    more = f"\n  ... and {len(errors) - shown} more" if len(errors) > shown else ""
    return f"data.path={path}: {len(errors)} bad line(s):\n  " + "\n  ".join(errors[:shown]) + more


def json_object_line(where: str, raw: bytes | str, expected: str) -> dict[str, Any]:
    """One JSONL line that must hold an object (`expected` shows its keys) -> the object; ValueError starting
    with `where` (`file:line`) saying what is wrong."""
    try:
        entry = json_line(raw)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object {expected}")
    return entry


def parse_line(raw: bytes | str, tokenizer: Any) -> tuple[list[int], list[bool]]:
    obj = json_line(raw)
    if not isinstance(obj, dict) or ("text" in obj) == ("messages" in obj):
        raise ValueError('each line must be an object with exactly one of "text" or "messages"')
    return text_document(obj["text"], tokenizer) if "text" in obj else chat_document(obj["messages"], tokenizer)


def read_documents(path: str | Path, tokenizer: Any, skip_bad_samples: bool = False) -> tuple[list[Document], int]:
    """Every document of the JSONL file(s) at `path`, in order; -> (documents, bad lines skipped)."""
    docs: list[Document] = []
    skipped = 0
    for file in jsonl_files(path):
        with file.open("rb") as f:  # decoded line by line: one bad byte is one bad line, not a crash
            for number, line in enumerate(f, start=1):
                where = f"{file}:{number}"
                try:
                    tokens, learn = parse_line(line, tokenizer)
                except ValueError as e:
                    if not skip_bad_samples:
                        raise TextDataError(
                            f"{where}: {e} (fix the line, or set data.skip_bad_samples: true)"
                        ) from None
                    log.warning("skipping %s: %s", where, e)
                    skipped += 1
                    continue
                docs.append(Document(tokens, learn, where))
    if not docs:
        raise TextDataError(f"data.path {path} has no usable documents ({skipped} bad lines skipped)")
    return docs, skipped


# ---------------------------------------------------------------- rows


def shifted_labels(tokens: list[int], learn: list[bool]) -> list[int]:
    """labels[t] = tokens[t + 1] where that token is learned; the document's last position predicts nothing."""
    return [tokens[t + 1] if learn[t + 1] else IGNORE_INDEX for t in range(len(tokens) - 1)] + [IGNORE_INDEX]


class _RowBuilder:
    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self.rows: list[tuple[list[int], list[int], list[int], list[int]]] = []
        self._reset()

    def _reset(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.labels: list[int] = []

    def room(self) -> int:
        return self.seq_len - len(self.ids)

    def add(self, doc: Document) -> None:
        self.ids += doc.tokens
        self.pos += list(range(len(doc.tokens)))
        self.labels += shifted_labels(doc.tokens, doc.learn)

    def flush(self) -> None:
        if not self.ids:
            return
        pad = self.room()
        last = self.pos[-1] + 1
        self.rows.append(
            (
                self.ids + [self.pad_id] * pad,
                self.pos + list(range(last, last + pad)),
                self.labels + [IGNORE_INDEX] * pad,
                [1] * len(self.ids) + [0] * pad,
            )
        )
        self._reset()


def build_rows(docs: list[Document], seq_len: int, pad_id: int, packing: bool = True) -> tuple[dict, int]:
    """Documents -> {"input_ids", "position_ids", "shift_labels", "attention_mask"}: [rows, seq_len] int64 tensors;
    -> (rows, documents truncated to seq_len)."""
    builder = _RowBuilder(seq_len, pad_id)
    truncated = 0
    for doc in docs:
        if len(doc.tokens) > seq_len:
            truncated += 1
            doc = Document(doc.tokens[:seq_len], doc.learn[:seq_len], doc.source)
        if not packing or builder.room() < len(doc.tokens):
            builder.flush()
        builder.add(doc)
    builder.flush()
    names = ("input_ids", "position_ids", "shift_labels", "attention_mask")
    return {name: torch.tensor([row[i] for row in builder.rows], dtype=torch.long) for i, name in enumerate(names)}, (
        truncated
    )


class TokenRows(Dataset):
    """Fixed token rows; item i = {"input_ids", "position_ids", "shift_labels", "attention_mask": [seq_len],
    "index": i}."""

    def __init__(self, rows: dict[str, torch.Tensor], stats: PackStats):
        self.rows = rows
        self.stats = stats

    def __len__(self) -> int:
        return self.rows["input_ids"].shape[0]

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**{k: v[index] for k, v in self.rows.items()}, "index": index}


def trim_padding(rows: dict[str, torch.Tensor], multiple: int = 1) -> dict[str, torch.Tensor]:
    """A micro-batch's stacked rows (sequence on the last dim, `attention_mask` [B, seq_len] with the real tokens
    first) cut to its longest row rounded up to a `multiple` (sequence parallelism: each SP rank an equal chunk;
    `data.seq_len` is checked to be one), never past `seq_len`: what a transformers loop pads a batch to. Only
    padding goes, which nothing learns or attends to (module doc), so the loss is unchanged."""
    seq_len = rows["attention_mask"].shape[-1]
    longest = int(rows["attention_mask"].sum(dim=-1).max())
    width = min(-(-longest // multiple) * multiple, seq_len)
    return {k: v[..., :width].contiguous() for k, v in rows.items()}


def collate_rows(samples: list[dict[str, Any]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """Stack rows into [B, L] tensors (`trim_padding`: L the longest row rounded up to `multiple`) plus
    "index": [B]."""
    out = trim_padding({k: torch.stack([s[k] for s in samples]) for k in samples[0] if k != "index"}, multiple)
    out["index"] = torch.tensor([s["index"] for s in samples])
    return out


def build_text_dataset(
    path: str | Path, tokenizer: Any, seq_len: int, packing: bool = True, skip_bad_samples: bool = False
) -> TokenRows:
    docs, skipped = read_documents(path, tokenizer, skip_bad_samples)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows, truncated = build_rows(docs, seq_len, pad_id, packing)
    label_tokens = int((rows["shift_labels"] != IGNORE_INDEX).sum())
    stats = PackStats(len(docs), rows["input_ids"].shape[0], truncated, skipped, label_tokens)
    if label_tokens == 0:
        raise TextDataError(f"data.path {path}: no document has a token to learn (every label is masked)")
    return TokenRows(rows, stats)
