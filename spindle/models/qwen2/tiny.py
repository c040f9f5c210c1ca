"""A tiny random qwen2 model in the transformers layout (`spindle tiny-model qwen2`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from spindle.models.shared.tiny_llm import QWEN3_TOKENIZER, build_tiny_causal_lm

# Qwen2.5's conventions are Qwen3's ChatML tokens without the think blocks; its template opens every
# conversation that has no system message with Qwen2.5's default one (a prefix of every longer conversation,
# as the chat-data masking needs). A tool result is a user turn wrapped in <tool_response>, as Qwen2.5 renders it.
CHAT_TEMPLATE = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] in ['user', 'assistant'] or (message['role'] == 'system' and not loop.first) %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER = replace(
    QWEN3_TOKENIZER,
    chat_template=CHAT_TEMPLATE,
    added_tokens=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
)
# Qwen2.5-0.5B ties its embeddings; q/k/v carry biases (Qwen2's attention always has them).
TINY_DEFAULTS = dict(tie_word_embeddings=True)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    return build_tiny_causal_lm(
        "qwen2", out, seed=seed, transformer=transformer, tokenizer_spec=TOKENIZER, defaults=TINY_DEFAULTS
    )
