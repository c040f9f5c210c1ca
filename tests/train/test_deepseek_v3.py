"""DeepSeek-V3 (spindle/models/deepseek_v3): what the registry-parametrised conformance suite does not check
by family name. Its tokenizer carries DeepSeek-V3's special tokens and chat template; expert parallelism
splits only the routed experts (the shared experts and the dense first layer stay whole on every rank);
LoRA on its latent-attention projections and on its fused routed experts equals stock PEFT. (DPO's step 1
against TRL: tests/train/test_preference_trl_parity.py, DPO_FAMILIES.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import lm_train, one_step_metrics
from tests.train.test_lm_lora import LORA, check_peft_and_merged, stock_peft_experts, trained_only_adapters


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tiny_checkpoint) -> Path:
    return tiny_checkpoint("deepseek_v3")


def test_tokenizer_has_deepseek_v3_special_tokens_and_chat_template(tiny_deepseek_v3):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_deepseek_v3)
    ids = tok("hello").input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<｜begin▁of▁sentence｜>")  # tokenizer(text) prepends bos
    assert tok.decode(ids[1:]) == "hello"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜>"
    prompt = tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<｜User｜>hi<｜Assistant｜>")
    for token in ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"):
        assert len(tok(token, add_special_tokens=False).input_ids) == 1, token
    assert tok.eos_token == "<｜end▁of▁sentence｜>" and tok.pad_token == "<｜▁pad▁｜>"


def test_expert_parallel_splits_only_the_routed_experts(tiny_deepseek_v3):
    """The EP plan names each MoE layer's fused routed experts; the shared experts, the router and the
    dense first layer's MLP are not expert parameters (FSDP2 shards them like any other layer)."""
    from spindle.distributed.expert_parallel import expert_param_names
    from spindle.registry import get_family
    from spindle.train.parts.experts import load_moe_model

    model = load_moe_model(get_family("deepseek_v3"), tiny_deepseek_v3)
    names = set(expert_param_names(model))
    moe_layers = range(model.config.first_k_dense_replace, model.config.num_hidden_layers)
    assert names == {f"model.layers.{i}.mlp.experts.{p}" for i in moe_layers for p in ("gate_up_proj", "down_proj")}
    assert all(f"model.layers.{i}.mlp.shared_experts.gate_proj.weight" not in names for i in moe_layers)


def test_lora_adapts_the_latent_attention_and_exports_a_peft_folder(tiny_deepseek_v3, lm_corpus, tmp_path):
    """Default LoRA targets: MLA's projections (the low-rank ones included). Not the shared experts' or the
    dense layer's gate/up/down_proj, which stock PEFT would re-target to the routed experts (spindle.train.lora),
    and not the routed experts (opt-in); stock peft + transformers load the PEFT folder with the trained
    model's outputs, and the merged folder loads alone."""
    trainer, _ = lm_train(tiny_deepseek_v3, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = {n.split(".lora_")[0].split(".layers.")[1].split(".", 1)[1] for n in trained_only_adapters(trainer)}
    attention = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    assert adapted == {f"self_attn.{p}" for p in attention}
    check_peft_and_merged(trainer, tiny_deepseek_v3, tmp_path / "run" / "export")


def test_lora_on_the_shared_experts_is_refused_with_the_reason(tiny_deepseek_v3, lm_corpus, tmp_path):
    from spindle.config import ConfigError

    lora = '{"rank": 4, "alpha": 8, "targets": ["shared_experts.gate_proj"]}'
    with pytest.raises(ConfigError, match="stock PEFT re-targets to the fused routed experts on a deepseek_v3"):
        lm_train(tiny_deepseek_v3, lm_corpus, tmp_path / "run", train__max_steps=1, train__lora=lora)


def test_lora_on_the_routed_experts_step_one_equals_stock_peft(tiny_deepseek_v3, tmp_path):
    """LoRA on the fused routed experts: Spindle's step-1 loss and grad norm equal stock transformers +
    stock PEFT (`target_parameters`) with the same initial adapters (1e-5)."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import STEP_ONE_TEXT, check_step_one

    lora = '{"rank": 4, "alpha": 8, "targets": ["experts.gate_up_proj", "experts.down_proj"]}'
    metrics = one_step_metrics(tiny_deepseek_v3, [STEP_ONE_TEXT], tmp_path, seq_len=32, train__lora=lora)
    model = stock_peft_experts(tiny_deepseek_v3, seed=0, rank=4, alpha=8)
    check_step_one(get_family("deepseek_v3"), tiny_deepseek_v3, metrics, model=model)
