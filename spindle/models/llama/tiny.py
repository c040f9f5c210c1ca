"""A tiny random llama model in the transformers layout (`spindle tiny-model llama`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import LLAMA3_TOKENIZER, build_tiny_causal_lm

TINY_DEFAULTS = dict(tie_word_embeddings=False)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Llama 3 tokenizers prepend <|begin_of_text|> to every text: exercises "tokenizer(text) with its own
    # special tokens".
    return build_tiny_causal_lm(
        "llama", out, seed=seed, transformer=transformer, tokenizer_spec=LLAMA3_TOKENIZER, defaults=TINY_DEFAULTS
    )
