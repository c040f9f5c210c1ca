"""A tiny random Gemma 3 text model in the transformers layout (`spindle tiny-model gemma3`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import LlmTokenizerSpec, build_tiny_causal_lm

# Gemma 3's conventions: `tokenizer(text)` prepends <bos> (ids pad 0, eos 1, bos 2, unk 3 as in Gemma's own
# vocabulary), turns are <start_of_turn>role\n...<end_of_turn>\n with the assistant named "model", a system
# message is folded into the first user turn, and the instruct models stop at <eos> or <end_of_turn>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ first_user_prefix if loop.first else '' }}{{ message['content'] | trim }}"
    "<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOKENIZER = LlmTokenizerSpec(
    special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    bos_token="<bos>",
    eos_token="<eos>",
    pad_token="<pad>",
    stop_tokens=["<eos>", "<end_of_turn>"],
    chat_template=CHAT_TEMPLATE,
)
# Gemma 3's layout at the tiny size: local (sliding-window) and global layers alternating (the real models
# have five local layers per global one: `sliding_window_pattern` 6), a window much shorter than the test rows
# so that it changes the result, and the attention scaled by query_pre_attn_scalar = head_dim as in the real
# models. Gemma ties its embeddings.
TINY_DEFAULTS = dict(sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=32, tie_word_embeddings=True)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    return build_tiny_causal_lm(
        "gemma3_text", out, seed=seed, transformer=transformer, tokenizer_spec=TOKENIZER, defaults=TINY_DEFAULTS
    )
