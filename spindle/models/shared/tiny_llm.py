"""Tiny random causal language models in the standard transformers folder layout (shared by the LLM
families' `tiny.py`).

`config.json` (with `model_type`), `model.safetensors`, `generation_config.json` and a locally built
tokenizer: what `AutoModelForCausalLM` / `AutoTokenizer` load from a real checkpoint, at ~1M
parameters, so tests, the demo and the bench exercise the real loading code. The tokenizer is
byte-level BPE like the family's own (any UTF-8 text round-trips, no <unk>) with the family's special
tokens and chat template (`LlmTokenizerSpec`): a user's own data and chats work as on the real model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from spindle.models.shared.tokenizers import save_byte_level_tokenizer


@dataclass(frozen=True)
class LlmTokenizerSpec:
    """A family's tokenizer conventions: its special tokens, their roles, its chat template and the
    tokens generation stops at."""

    special_tokens: list[str]
    bos_token: str | None
    eos_token: str
    pad_token: str
    stop_tokens: list[str]
    chat_template: str
    added_tokens: list[str] = field(default_factory=list)


# Qwen3's conventions: ChatML turns (<|im_start|>role\n...<|im_end|>\n), no bos, eos <|im_end|>, pad
# <|endoftext|>; <think>/</think> are plain added tokens. The template follows Qwen3's: a tool result
# is a user turn wrapped in <tool_response>, an assistant's `reasoning_content` is rendered as a
# <think> block, and `enable_thinking=False` opens the answer with an empty think block. (Qwen3's own
# template also drops the think blocks of earlier turns; here every turn renders the same whatever
# follows it, which the chat-data masking relies on: spindle.data.text renders prefixes.)
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% set content = message['content'] %}"
    "{% if message.reasoning_content is defined and message.reasoning_content %}"
    "{% set content = '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n{{ content }}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% elif message['role'] in ['system', 'user'] %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
QWEN3_TOKENIZER = LlmTokenizerSpec(
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    stop_tokens=["<|im_end|>", "<|endoftext|>"],
    chat_template=QWEN3_CHAT_TEMPLATE,
    added_tokens=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
)

# Llama 3's conventions: `tokenizer(text)` prepends <|begin_of_text|>, turns are
# <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>, eos <|eot_id|> (the instruct models'),
# pad the reserved <|finetune_right_pad_id|>.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'ipython', 'tool'] %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA3_TOKENIZER = LlmTokenizerSpec(
    special_tokens=[
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|finetune_right_pad_id|>",
    ],
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    pad_token="<|finetune_right_pad_id|>",
    stop_tokens=["<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"],
    chat_template=LLAMA3_CHAT_TEMPLATE,
)


def save_llm_tokenizer(out: Path, spec: LlmTokenizerSpec, model_max_length: int = 2048) -> None:
    """The family's byte-level tokenizer (`spec`) written into `out`."""
    save_byte_level_tokenizer(
        out,
        spec.special_tokens,
        spec.chat_template,
        {"bos_token": spec.bos_token, "eos_token": spec.eos_token, "pad_token": spec.pad_token},
        added_tokens=spec.added_tokens,
        model_max_length=model_max_length,
    )


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
    tokenizer_spec: LlmTokenizerSpec = QWEN3_TOKENIZER,
    defaults: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny random `model_type` ForCausalLM + its family's tokenizer (`tokenizer_spec`) to `out`.

    `defaults`: the family's shape choices over `TINY_LLM`; `transformer`: the caller's overrides merged
    into the model config last (e.g. `{"num_hidden_layers": 2}`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    out = Path(out)
    save_llm_tokenizer(out, tokenizer_spec)
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
    # Generation stops at the end of a document or of a chat turn (the family's stop tokens).
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer_spec.stop_tokens),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
