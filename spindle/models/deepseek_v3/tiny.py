"""A tiny random deepseek_v3 model in the transformers layout (`spindle tiny-model deepseek_v3`)."""

from __future__ import annotations

from pathlib import Path

from spindle.models.shared.tiny_llm import LlmTokenizerSpec, build_tiny_causal_lm

# DeepSeek-V3's conventions: `tokenizer(text)` prepends <｜begin▁of▁sentence｜>; a conversation is the system
# prompt, then <｜User｜>... and <｜Assistant｜>...<｜end▁of▁sentence｜> turns, tool results between
# <｜tool▁output▁begin｜> and <｜tool▁output▁end｜>; eos <｜end▁of▁sentence｜>, pad <｜▁pad▁｜>. (DeepSeek's template
# renders system prompts first wherever they are; here each turn renders where it is, whatever follows it,
# which the chat-data masking relies on: spindle.data.text renders prefixes.)
DEEPSEEK_V3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>"
    "{% elif message['role'] == 'tool' %}<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
DEEPSEEK_V3_TOKENIZER = LlmTokenizerSpec(
    special_tokens=[
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜▁pad▁｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ],
    bos_token="<｜begin▁of▁sentence｜>",
    eos_token="<｜end▁of▁sentence｜>",
    pad_token="<｜▁pad▁｜>",
    stop_tokens=["<｜end▁of▁sentence｜>"],
    chat_template=DEEPSEEK_V3_CHAT_TEMPLATE,
)

# DeepSeek-V3's shape, scaled down: MLA with a query low-rank projection (q_lora_rank) and a compressed
# key/value (kv_lora_rank), heads of a no-RoPE part and a RoPE part, a value head of its own size; one dense
# layer first (first_k_dense_replace), then MoE layers of 8 routed experts in 4 groups (top-2 groups, top-2
# experts, sigmoid scores, normalised and scaled as V3's) plus one shared expert; untied embeddings.
# hidden_size and moe_intermediate_size rows are multiples of 16 bytes: CPU grouped_mm runs.
TINY_DEFAULTS = dict(
    tie_word_embeddings=False,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def build_tiny(out: str | Path, seed: int = 0, transformer: dict | None = None) -> Path:
    # Saved by stock save_pretrained: the per-expert layout real DeepSeek-V3 checkpoints have.
    return build_tiny_causal_lm(
        "deepseek_v3",
        out,
        seed=seed,
        transformer=transformer,
        tokenizer_spec=DEEPSEEK_V3_TOKENIZER,
        defaults=TINY_DEFAULTS,
    )
