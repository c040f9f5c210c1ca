"""A tiny random qwen3 model in the transformers layout (`spindle tiny-model qwen3`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, build_tiny_causal_lm

# Qwen3-0.6B ties its embeddings.
TINY_DEFAULTS = dict(tie_word_embeddings=True)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    return build_tiny_causal_lm(
        "qwen3", out, seed=seed, transformer=transformer, tokenizer_spec=QWEN3_TOKENIZER, defaults=TINY_DEFAULTS
    )
