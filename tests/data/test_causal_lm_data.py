"""Text/chat JSONL -> token rows: tokenization, assistant-only labels, packing, truncation, bad lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spindle.data.text import (
    IGNORE_INDEX,
    TextDataError,
    build_rows,
    build_text_dataset,
    collate_rows,
    read_documents,
)
from tests.conftest import CHAT_LINES


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3)


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs), encoding="utf-8")
    return path


def test_text_line_is_tokenizer_output_plus_eos_all_learned(tokenizer, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    f = write_jsonl(tmp_path / "a.jsonl", [{"text": "the red circle moves left"}])
    for tok in (tokenizer, AutoTokenizer.from_pretrained(tiny_llama)):  # llama's tokenizer adds <s> itself
        (doc,), _ = read_documents(f, tok)
        assert doc.tokens == [*tok("the red circle moves left").input_ids, tok.eos_token_id]
        assert all(doc.learn)
    assert doc.tokens[0] == tok.bos_token_id


def test_chat_line_learns_only_assistant_turns(tokenizer, tmp_path):
    messages = CHAT_LINES[1]
    f = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}])
    (doc,), _ = read_documents(f, tokenizer)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert doc.tokens == tokenizer(rendered, add_special_tokens=False).input_ids
    learned = tokenizer.decode([t for t, keep in zip(doc.tokens, doc.learn, strict=True) if keep])
    # each assistant turn to its end: the text, <|im_end|> and the template's newline after it
    assert learned == "left then right then up<|im_end|>\na square<|im_end|>\n"


def test_packing_restarts_positions_and_never_predicts_across_documents(tokenizer, tmp_path):
    texts = ["the red circle", "a blue square moves up", "the sky"]
    f = write_jsonl(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    docs, _ = read_documents(f, tokenizer)
    lengths = [len(d.tokens) for d in docs]
    rows, truncated = build_rows(docs, seq_len=sum(lengths) + 3, pad_id=tokenizer.pad_token_id)
    assert truncated == 0 and rows["input_ids"].shape == (1, sum(lengths) + 3)
    pos, labels, ids = rows["position_ids"][0], rows["shift_labels"][0], rows["input_ids"][0]
    start = 0
    for doc, n in zip(docs, lengths, strict=True):
        assert pos[start : start + n].tolist() == list(range(n))
        assert ids[start : start + n].tolist() == doc.tokens
        assert labels[start : start + n - 1].tolist() == doc.tokens[1:]
        assert labels[start + n - 1] == IGNORE_INDEX  # the last token of a document predicts nothing
        start += n
    assert (labels[start:] == IGNORE_INDEX).all() and (ids[start:] == tokenizer.pad_token_id).all()


def test_packing_starts_a_new_row_when_a_document_does_not_fit(tokenizer, tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"text": "the red circle moves left"}] * 3)  # 6 tokens each
    docs, _ = read_documents(f, tokenizer)
    rows, _ = build_rows(docs, seq_len=14, pad_id=0)
    assert rows["input_ids"].shape == (2, 14)
    assert rows["position_ids"][0].tolist()[:12] == list(range(6)) * 2
    assert rows["position_ids"][1].tolist()[:6] == list(range(6))


def test_no_packing_truncates_and_pads_one_document_per_row(tokenizer, tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "the red circle moves left on a gray background"}, {"text": "a"}])
    ds = build_text_dataset(f, tokenizer, seq_len=5, packing=False)
    assert len(ds) == 2 and ds.stats.truncated == 1
    long, short = ds[0], ds[1]
    assert long["position_ids"].tolist() == list(range(5))
    assert long["shift_labels"][-1] == IGNORE_INDEX  # the cut document's last kept token predicts nothing
    assert short["input_ids"].tolist()[2:] == [tokenizer.pad_token_id] * 3
    assert short["shift_labels"].tolist() == [tokenizer.eos_token_id] + [IGNORE_INDEX] * 4
    # padding is marked (the MoE router statistics skip it); the truncated row has none
    assert short["attention_mask"].tolist() == [1, 1, 0, 0, 0] and long["attention_mask"].tolist() == [1] * 5


@pytest.mark.parametrize("multiple,width", [(1, 6), (2, 6), (4, 8), (5, 10)])
def test_micro_batch_is_padded_to_its_longest_row_not_seq_len(tokenizer, tmp_path, multiple, width):
    # what a transformers loop pads a batch to (its longest row: 6 tokens), rounded up to the SP degree (each SP
    # rank an equal chunk), not data.seq_len; only padding is cut: the batch is the seq_len rows' first tokens
    f = write_jsonl(tmp_path / "s.jsonl", [{"text": "the red circle moves left"}, {"text": "a"}])  # 6, 2 tokens
    ds = build_text_dataset(f, tokenizer, seq_len=64, packing=False)
    rows = [ds[0], ds[1]]
    batch = collate_rows(rows, multiple=multiple)
    for key in ("input_ids", "position_ids", "shift_labels", "attention_mask"):
        assert batch[key].shape == (2, width)
        assert torch.equal(batch[key], torch.stack([r[key] for r in rows])[:, :width])
    assert batch["attention_mask"].sum(dim=1).tolist() == [6, 2] and batch["index"].tolist() == [0, 1]


@pytest.mark.parametrize(
    "line,message",
    [
        ("", "empty line"),
        ("{not json", "not valid JSON"),
        (json.dumps({"caption": "x"}), 'exactly one of "text" or "messages"'),
        (json.dumps({"text": "  "}), "non-empty string"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant turn"),
        (json.dumps({"messages": [{"role": "user"}]}), 'string "role" and "content"'),
    ],
)
def test_bad_line_is_named_with_file_and_line(tokenizer, tmp_path, line, message):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"text": "the red circle"}, line])
    with pytest.raises(TextDataError, match=rf"bad\.jsonl:2: .*{message}.*data\.skip_bad_samples"):
        read_documents(f, tokenizer)
    docs, skipped = read_documents(f, tokenizer, skip_bad_samples=True)
    assert len(docs) == 1 and skipped == 1


def test_folder_is_read_in_sorted_order_and_missing_path_is_named(tokenizer, tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "the sky"}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "the red circle"}])
    docs, _ = read_documents(tmp_path, tokenizer)
    assert [Path(d.source).name for d in docs] == ["a.jsonl:1", "b.jsonl:1"]
    with pytest.raises(TextDataError, match="does not exist"):
        read_documents(tmp_path / "nope", tokenizer)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TextDataError, match=r"no \.jsonl files"):
        read_documents(empty, tokenizer)


def test_rows_are_identical_on_every_build(tokenizer, lm_corpus):
    a = build_text_dataset(lm_corpus, tokenizer, seq_len=48)
    b = build_text_dataset(lm_corpus, tokenizer, seq_len=48)
    assert all(torch.equal(a.rows[k], b.rows[k]) for k in a.rows)
    assert a.stats.documents == 26 and a.stats.label_tokens > 0
