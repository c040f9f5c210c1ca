"""Tiny random causal language models in the standard transformers folder layout (shared by the LLM
families' `tiny.py`).

`config.json` (with `model_type`), `model.safetensors`, `generation_config.json` and a locally built
tokenizer with a chat template: what `AutoModelForCausalLM` / `AutoTokenizer` load from a real
checkpoint, at ~1M parameters, so tests, the demo and the bench exercise the real loading code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spindle.models.shared.tokenizers import save_chat_tokenizer

# Qwen3-0.6B's shape ratios, scaled down: GQA (2 KV heads for 4 query heads), explicit head_dim, tied
# embeddings (Qwen3-0.6B ties them; Llama does not).
TINY_LLM = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)


def build_tiny_causal_lm(
    model_type: str,
    out: str | Path,
    seed: int = 0,
    transformer: dict | None = None,
    bos_token: str | None = None,
    defaults: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random `model_type` ForCausalLM + tokenizer to `out`; returns `out`.

    `defaults`: the family's shape choices over `TINY_LLM`; `transformer`: the caller's overrides merged
    into the model config last (e.g. `{"num_hidden_layers": 2}`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = Path(out)
    save_chat_tokenizer(out, bos_token=bos_token)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out)
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    cfg = {**TINY_LLM, **(defaults or {}), **ids, **(transformer or {})}
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Generation stops at the end of a document or of a chat turn.
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
