"""A tiny random llama model in the transformers layout (`spindle tiny-model llama`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import build_tiny_causal_lm

TINY_DEFAULTS = dict(tie_word_embeddings=False)


def build_tiny_llama(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Llama tokenizers prepend <s> to every text: exercises "tokenizer(text) with its own special tokens".
    return build_tiny_causal_lm(
        "llama", out, seed=seed, transformer=transformer, bos_token="<s>", defaults=TINY_DEFAULTS
    )
