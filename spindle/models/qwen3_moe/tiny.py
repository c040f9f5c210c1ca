"""A tiny random qwen3_moe model in the transformers layout (`spindle tiny-model qwen3_moe`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, build_tiny_causal_lm

# Qwen3-30B-A3B's MoE shape, scaled down: every layer sparse, 8 experts, top-2, untied embeddings.
TINY_DEFAULTS = dict(
    tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Saved by stock save_pretrained: the per-expert layout (experts.{j}.gate_proj.weight ...) real
    # Qwen3-MoE checkpoints have, which transformers fuses on load.
    return build_tiny_causal_lm(
        "qwen3_moe", out, seed=seed, transformer=transformer, tokenizer_spec=QWEN3_TOKENIZER, defaults=TINY_DEFAULTS
    )
