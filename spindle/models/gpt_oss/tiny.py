"""A tiny random gpt_oss model in the transformers layout (`spindle tiny-model gpt_oss`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import LlmTokenizerSpec, build_tiny_causal_lm

# GPT-OSS's conventions (the harmony format of openai/gpt-oss-20b's tokenizer): nothing prepended by
# `tokenizer(text)`; a message is <|start|>{role}<|message|>{content}<|end|>, an assistant's answer goes on the
# final channel (<|start|>assistant<|channel|>final<|message|>...) and ends with <|return|>, the token
# generation stops at (with <|call|> and <|endoftext|>); pad <|endoftext|>. (Stock's template also writes a
# dated system preamble, the reasoning effort and the analysis channel, and ends earlier assistant turns with
# <|end|>; here each turn renders the same wherever it is, which the chat-data masking relies on:
# spindle.data.text renders prefixes.)
GPT_OSS_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|return|>"
    "{% elif message['role'] in ['system', 'developer', 'user', 'tool'] %}"
    "<|start|>{{ message['role'] }}<|message|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
GPT_OSS_TOKENIZER = LlmTokenizerSpec(
    special_tokens=[
        "<|startoftext|>",
        "<|endoftext|>",
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    ],
    bos_token=None,  # gpt-oss's tokenizer names <|startoftext|> its bos but never prepends it
    eos_token="<|return|>",
    pad_token="<|endoftext|>",
    stop_tokens=["<|return|>", "<|endoftext|>", "<|call|>"],
    chat_template=GPT_OSS_CHAT_TEMPLATE,
)

# gpt-oss-20b's shape, scaled down: every layer MoE (8 experts, top-2, biased experts and router), layers
# alternating sliding-window (a window shorter than the test rows, so it masks) and full attention, one sink
# logit per head, attention biases, untied embeddings, YaRN RoPE as released. hidden_size and the experts'
# intermediate_size rows are multiples of 16 bytes: CPU grouped_mm runs.
TINY_DEFAULTS = dict(
    tie_word_embeddings=False,
    intermediate_size=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    num_key_value_heads=2,
    # the released YaRN scaling (factor 32), its original context scaled as max_position_embeddings is
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Saved by stock save_pretrained: the fused bf16/fp32 layout (gate_up_proj [E, H, 2I] ...), the model's own
    return build_tiny_causal_lm(
        "gpt_oss", out, seed=seed, transformer=transformer, tokenizer_spec=GPT_OSS_TOKENIZER, defaults=TINY_DEFAULTS
    )
