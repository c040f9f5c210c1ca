"""The tiny LLM tokenizers are byte-level like the real ones (issue 25.5): any UTF-8 text round-trips
with no <unk>, and each carries its family's special tokens and chat template."""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

TRICKY = [
    "Grüße aus Köln, 世界! 🎉🧵",
    "e\u0301 vs \u00e9 (not normalised)",
    "  leading spaces, tabs\tand\r\nnewlines \n\n",
    "<|im_start|> written as text, <think>, &amp; \\u0000 \x00",
    "",
]


def random_text(rng: random.Random, length: int) -> str:
    """Any Unicode scalar values (every plane; surrogates are not text), ASCII-heavy like real data."""
    chars = []
    for _ in range(length):
        if rng.random() < 0.5:
            chars.append(chr(rng.randrange(0x20, 0x7F)))
        else:
            code = rng.randrange(0, 0x110000)
            chars.append(chr(code if not 0xD800 <= code <= 0xDFFF else code - 0x800))
    return "".join(chars)


@pytest.mark.parametrize("family", ["tiny_qwen3", "tiny_llama"])
def test_any_utf8_text_round_trips_with_no_unknown_token(family, request):
    tok = AutoTokenizer.from_pretrained(request.getfixturevalue(family))
    assert tok.unk_token is None and tok.unk_token_id is None
    rng = random.Random(0)
    texts = TRICKY + [random_text(rng, rng.randrange(1, 200)) for _ in range(200)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # the training vocabulary is compact: a known sentence is about one token per word
    assert len(tok("the red circle moves left", add_special_tokens=False)["input_ids"]) == 5


def test_qwen3_tokenizer_has_qwen3s_tokens_and_template(tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    for marker in ("<|im_start|>", "<|im_end|>", "<think>", "</think>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1
    chat = [
        {"role": "system", "content": "you say one word"},
        {"role": "user", "content": "what colour"},
        {"role": "assistant", "content": "red", "reasoning_content": "the circle is red"},
    ]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nyou say one word<|im_end|>\n<|im_start|>user\nwhat colour<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nthe circle is red\n</think>\n\nred<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(chat[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    generation = json.loads((tiny_qwen3 / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def test_llama_tokenizer_has_llama3s_tokens_and_template(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert tok("hi")["input_ids"][0] == tok.bos_token_id  # tokenizer(text) prepends it, like Llama 3's
    chat = [{"role": "user", "content": "what colour"}, {"role": "assistant", "content": " red "}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nwhat colour<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nred<|eot_id|>"
    )
    generation = json.loads((tiny_llama / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"])
