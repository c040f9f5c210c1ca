"""Preference pairs and GRPO prompts (spindle.data.preference) tokenised exactly as TRL 1.16 does it.

The reference is TRL's own processing code, called on the same lines and tokenizer: `DPOTrainer._prepare_dataset`
(prompt extraction, EOS, tokenisation and the prompt/completion split), `DataCollatorForPreference` (truncation to
`max_length`, padding, completion mask), `RewardTrainer._prepare_dataset`, `trl.extract_prompt` and
`GRPOTrainer._tokenize_prompts`. They are methods that read a few attributes of the trainer, so they run on a
stand-in object holding those attributes (no model, no training).
"""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset  # TRL's own dependency: its trainers prepare `datasets.Dataset`s
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.reward_trainer import DataCollatorForPreference as RewardCollator
from trl.trainer.reward_trainer import RewardTrainer

from spindle.data.preference import (
    PreferenceDataError,
    collate_pairs,
    collate_reward_pairs,
    extract_prompt,
    preference_pairs,
    read_prompts,
    reward_pairs,
)


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


# Each format in its own file (TRL's datasets hold one format); prompts that end on a space and completions
# without one make byte-level BPE merge tokens across the boundary, so the split is not always after the prompt.
LINES = {
    "standard": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green, mostly."},
        {"prompt": "Answer: ", "chosen": "yes", "rejected": "no way"},
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "id": 7},
        {"prompt": "Say it twice", "chosen": " same", "rejected": " same"},
    ],
    "conversational": [
        {"prompt": user("What color is the sky?"), "chosen": assistant("Blue."), "rejected": assistant("Green.")},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, *user("hi")],
            "chosen": assistant("hello"),
            "rejected": assistant("go away, I am busy"),
        },
    ],
    "implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "Paris is the capital", "rejected": "Paris is a city"},
    ],
    "implicit_conversational": [
        {
            "chosen": [*user("Where is the sun?"), *assistant("In the sky.")],
            "rejected": [*user("Where is the sun?"), *assistant("In the sea.")],
        },
    ],
}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def trl_config(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path / "trl"), report_to=[], bf16=False, use_cpu=True, **kw)


def trl_dpo_dataset(lines, tokenizer, tmp_path, max_length=None):
    """`DPOTrainer._prepare_dataset` on `lines` (it reads only the trainer's tokenizer)."""
    stand_in = types.SimpleNamespace(_tokenizer=tokenizer)
    args = trl_config(trl.DPOConfig, tmp_path, max_length=max_length)
    return DPOTrainer._prepare_dataset(stand_in, Dataset.from_list(lines), tokenizer, args, "train")


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tokenizer(request, tiny_checkpoint):
    """Qwen3's (no BOS, ChatML) and Llama 3's (`tokenizer(text)` adds <|begin_of_text|>) tiny tokenizers."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint(request.param))


@pytest.mark.parametrize("fmt", list(LINES))
def test_pairs_tokenise_as_trl_dpo_trainer(fmt, tokenizer, tmp_path):
    lines = LINES[fmt]
    pairs, stats = preference_pairs(write_jsonl(tmp_path / "p.jsonl", lines), tokenizer, seq_len=4096)
    expected = trl_dpo_dataset(lines, tokenizer, tmp_path)
    assert [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs] == [
        (e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]) for e in expected
    ]
    assert [p.source for p in pairs] == [f"{tmp_path / 'p.jsonl'}:{i}" for i in range(1, len(lines) + 1)]
    assert (stats.truncated, stats.dropped, stats.prompt_truncated) == (0, 0, 0)


def test_a_boundary_merge_moves_the_split_as_trl_does(tiny_qwen3, tmp_path):
    """The case the common-prefix rule exists for: here the tokenised prompt is not a prefix of prompt+completion."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    line = LINES["standard"][1]  # "Answer: " + "yes"
    prompt_alone = tokenizer(text=line["prompt"])["input_ids"]
    (pair,), _ = preference_pairs(write_jsonl(tmp_path / "p.jsonl", [line]), tokenizer, seq_len=64)
    assert pair.prompt_ids != prompt_alone  # the merge happened: the split is not after the tokenised prompt
    (expected,) = trl_dpo_dataset([line], tokenizer, tmp_path)
    assert (pair.prompt_ids, pair.chosen_ids) == (expected["prompt_ids"], expected["chosen_ids"])


@pytest.mark.parametrize("seq_len", [6, 9, 14])
def test_truncation_and_batches_equal_trl_collator(seq_len, tokenizer, tmp_path):
    """Cut to seq_len keeping the start, prompts that fill it dropped: TRL's max_length with keep_start."""
    lines = LINES["standard"] + [{"prompt": "A long prompt " * 8, "chosen": " short", "rejected": " also short"}]
    pairs, stats = preference_pairs(write_jsonl(tmp_path / "p.jsonl", lines), tokenizer, seq_len=seq_len)
    expected = trl_dpo_dataset(lines, tokenizer, tmp_path, max_length=seq_len)
    assert stats.dropped == len(lines) - len(expected) >= 1  # the long prompt fills seq_len: dropped by both
    pad = tokenizer.pad_token_id
    ours = collate_pairs(pairs, pad)
    theirs = DataCollatorForPreference(pad_token_id=pad, max_length=seq_len)(list(expected))
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["input_ids"].shape[1] <= seq_len
    # shift_labels: each position's next token where that token is a completion token
    labels = ours["shift_labels"]
    assert torch.equal(labels[:, :-1], ours["input_ids"][:, 1:].masked_fill(ours["completion_mask"][:, 1:] == 0, -100))


def test_max_prompt_length_keeps_the_prompt_end(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    path = write_jsonl(tmp_path / "p.jsonl", LINES["conversational"])
    full, _ = preference_pairs(path, tokenizer, seq_len=4096)
    cut, stats = preference_pairs(path, tokenizer, seq_len=4096, max_prompt_length=5)
    assert [p.prompt_ids for p in cut] == [p.prompt_ids[-5:] for p in full]
    assert [p.chosen_ids for p in cut] == [p.chosen_ids for p in full]
    assert stats.prompt_truncated == 2


def test_reward_pairs_equal_trl_reward_trainer(tokenizer, tmp_path):
    lines = [{**line, "margin": float(i)} for i, line in enumerate(LINES["standard"])]
    seq_len = 9
    pairs, stats = reward_pairs(write_jsonl(tmp_path / "p.jsonl", lines), tokenizer, seq_len=seq_len)
    stand_in = types.SimpleNamespace(_tokenizer=tokenizer)
    args = trl_config(trl.RewardConfig, tmp_path, max_length=seq_len)
    expected = RewardTrainer._prepare_dataset(stand_in, Dataset.from_list(lines), tokenizer, args, "train")
    assert len(expected) < len(lines)  # the limit drops some: the same ones
    assert [(p.prompt_ids + p.chosen_ids, p.prompt_ids + p.rejected_ids) for p in pairs] == [
        (e["chosen_ids"], e["rejected_ids"]) for e in expected
    ]
    assert stats.dropped == len(lines) - len(expected)
    pad = tokenizer.pad_token_id
    ours = collate_reward_pairs(pairs, pad)
    theirs = RewardCollator(pad_token_id=pad)(list(expected))
    for key in ("input_ids", "attention_mask", "margin"):
        assert torch.equal(ours[key], theirs[key]), key
    assert torch.equal(ours["last_index"], theirs["attention_mask"].sum(1) - 1)


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        ("The sky is blue.", "The sky is green."),
        ("Hello there", "Hello world"),
        ("same", "same"),  # one is a prefix of the other: TRL's split one character before the end
        ("abc", "abcdef"),
        ([*user("q"), *assistant("a")], [*user("q"), *assistant("b")]),
        ([*user("q"), *assistant("a"), *user("r"), *assistant("c")], [*user("q"), *assistant("a"), *user("s")]),
    ],
)
def test_implicit_prompt_equals_trl_extract_prompt(chosen, rejected):
    expected = trl.extract_prompt({"chosen": chosen, "rejected": rejected})
    assert extract_prompt(chosen, rejected) == (expected["prompt"], expected["chosen"], expected["rejected"])


BAD_LINES = [
    ('{"prompt": "p", "chosen": "a"}', 'missing "rejected"'),
    ('{"prompt": "p", "rejected": "a"}', 'missing "chosen"'),
    ('{"prompt": "p", "chosen": "  ", "rejected": "b"}', '"chosen" is empty'),
    ('{"prompt": "", "chosen": "a", "rejected": "b"}', '"prompt" is empty'),
    ('{"prompt": "p", "chosen": [], "rejected": "b"}', "empty message list"),
    ('{"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}', "both be strings"),
    ('{"prompt": [{"role": "user", "content": "p"}], "chosen": "a", "rejected": "b"}', "all be strings"),
    ('{"prompt": "p", "chosen": [{"content": "a"}], "rejected": [{"content": "b"}]}', 'string "role"'),
    ('{"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}', '"margin" must be a finite number'),
    ('{"chosen": "abc", "rejected": "xyz"}', "no implicit prompt"),
    ('{"chosen": "ab ", "rejected": "ab x"}', '"chosen" is empty once the prompt'),  # only a space is left
    (
        '{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}], '
        '"chosen": [{"role": "assistant", "content": "a cat"}], "rejected": [{"role": "assistant", "content": "a dog"}]}',
        "message 0 has a list of content parts",
    ),
    ("not json", "not valid JSON"),
    ('["prompt", "chosen"]', "each line must be an object"),
]


@pytest.mark.parametrize("line, message", BAD_LINES)
def test_a_bad_line_is_named_by_file_and_line(line, message, tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    path = write_jsonl(tmp_path / "p.jsonl", [LINES["standard"][0], line])
    with pytest.raises(PreferenceDataError, match=rf"p\.jsonl:2: .*{message}"):
        preference_pairs(path, tokenizer, seq_len=64)


def test_margin_on_some_lines_only_is_an_error(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    lines = [{**LINES["standard"][0], "margin": 1.0}, LINES["standard"][1]]
    with pytest.raises(PreferenceDataError, match=r'p\.jsonl:2: no "margin", but .*p\.jsonl:1 has one'):
        reward_pairs(write_jsonl(tmp_path / "p.jsonl", lines), tokenizer, seq_len=64)


def test_identical_pairs_are_counted_and_named(tiny_qwen3, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    path = write_jsonl(tmp_path / "p.jsonl", LINES["standard"])  # line 4: chosen == rejected
    with caplog.at_level(logging.WARNING, logger="spindle.data"):
        _, stats = preference_pairs(path, tokenizer, seq_len=64)
    assert (stats.identical, stats.pairs) == (1, 4)
    assert "1 of 4 pairs have chosen == rejected" in caplog.text and f"{path}:4" in caplog.text


PROMPTS = {
    "standard": [{"prompt": "Count to three:", "answer": "1 2 3"}, {"prompt": "Name a color", "answer": "red"}],
    "conversational": [
        {"prompt": user("What is 2+2?"), "answer": "4", "level": 1},
        {"prompt": [{"role": "system", "content": "Be brief."}, *user("hi")], "answer": "hello", "level": 2},
    ],
}


@pytest.mark.parametrize("fmt", list(PROMPTS))
def test_prompts_tokenise_as_trl_grpo_and_keep_their_columns(fmt, tokenizer, tmp_path):
    lines = PROMPTS[fmt]
    prompts = read_prompts(write_jsonl(tmp_path / "p.jsonl", lines), tokenizer)
    stand_in = types.SimpleNamespace(
        _is_vlm=False,
        environment_factories=None,
        processing_class=tokenizer,
        tools=None,
        chat_template=None,
        chat_template_kwargs={},
    )
    expected_ids, _, _ = GRPOTrainer._tokenize_prompts(stand_in, [line["prompt"] for line in lines])
    assert [p.prompt_ids for p in prompts] == [list(ids) for ids in expected_ids]
    assert [p.columns for p in prompts] == [{k: v for k, v in line.items() if k != "prompt"} for line in lines]
    assert [p.prompt for p in prompts] == [line["prompt"] for line in lines]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"question": "p"}', 'with a "prompt"'),
        ('{"prompt": ""}', '"prompt" is empty'),
        ('{"prompt": "p", "completion": "c"}', "column 'completion' is the name"),
    ],
)
def test_a_bad_prompt_line_is_named(line, message, tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    with pytest.raises(PreferenceDataError, match=rf"p\.jsonl:2: .*{message}"):
        read_prompts(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, line]), tokenizer)
