"""GPT-OSS (spindle/models/gpt_oss): what the registry-parametrised conformance suite does not check by family
name. Its tokenizer carries the harmony tokens and a harmony chat template; attention is transformers' eager
(the sinks), sdpa/varlen and Ulysses SP refused naming why; expert parallelism splits the fused experts with
their biases; LoRA on attention and on the fused experts equals stock PEFT; the released MXFP4 layout is
dequantised on load (equal to transformers' own dequantisation) and exported in bf16 that stock loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import lm_train, one_step_metrics
from tests.train.test_lm_lora import LORA, check_peft_and_merged, stock_peft_experts, trained_only_adapters


@pytest.fixture(scope="module")
def tiny_gpt_oss(tiny_checkpoint) -> Path:
    return tiny_checkpoint("gpt_oss")


def test_tokenizer_has_harmony_tokens_and_chat_template(tiny_gpt_oss):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_gpt_oss)
    assert tok.decode(tok("hello").input_ids) == "hello"  # no bos prepended, as gpt-oss's tokenizer
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat.append({"role": "assistant", "content": "yo"})
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|start|>system<|message|>be brief<|end|><|start|>user<|message|>hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>yo<|return|>"
    )
    prompt = tok.apply_chat_template(chat[1:2], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|start|>user<|message|>hi<|end|><|start|>assistant"
    for token in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|endoftext|>"):
        assert len(tok(token, add_special_tokens=False).input_ids) == 1, token
    assert tok.eos_token == "<|return|>" and tok.pad_token == "<|endoftext|>"


def test_attention_is_eager_and_sdpa_varlen_are_refused_naming_the_sinks(tiny_gpt_oss, tmp_path):
    from spindle.api import load_job_config, make_trainer
    from spindle.config import ConfigError
    from tests.conftest import lm_overrides

    overrides = lm_overrides(tiny_gpt_oss, _text(tmp_path), tmp_path / "run")
    for setting in ("sdpa", "varlen"):
        cfg = load_job_config(None, [*overrides, f"model.attn_implementation={setting}"])
        with pytest.raises(ConfigError, match=f"{setting}: transformers refuses sdpa for GptOssForCausalLM.*sink"):
            make_trainer(cfg)
    trainer = make_trainer(load_job_config(None, overrides))  # model.attn_implementation: auto
    assert trainer.model.config._attn_implementation == "eager"


def test_sequence_parallel_is_refused_before_launch_naming_the_sinks(tiny_gpt_oss, tmp_path):
    from spindle.api import load_job_config
    from spindle.config import ConfigError
    from spindle.distributed.mesh import ParallelDims
    from spindle.registry import get_family
    from spindle.train.tasks.causal_lm import CausalLMTask
    from tests.conftest import lm_overrides

    cfg = load_job_config(None, lm_overrides(tiny_gpt_oss, _text(tmp_path), tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"parallel.sp=2: .*sink logit per head.*set parallel.sp: 1"):
        CausalLMTask.check_plan(cfg, get_family("gpt_oss"), ParallelDims(sp=2, dp_shard=1).resolve(2))


def test_expert_parallel_splits_the_fused_experts_and_their_biases(tiny_gpt_oss):
    """The EP plan names every layer's fused expert weights and biases; the router (a weight and a bias per
    expert, outside the experts module) is not an expert parameter."""
    from spindle.distributed.expert_parallel import expert_param_names
    from spindle.registry import get_family
    from spindle.train.parts.experts import load_moe_model

    model = load_moe_model(get_family("gpt_oss"), tiny_gpt_oss)
    names = set(expert_param_names(model))
    params = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    layers = range(model.config.num_hidden_layers)
    assert names == {f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in params}


def test_lora_adapts_the_attention_and_exports_a_peft_folder(tiny_gpt_oss, lm_corpus, tmp_path):
    """Default LoRA targets: q/k/v/o of every layer (sliding and full alike; the experts are opt-in); stock
    peft + transformers load the PEFT folder with the trained model's outputs, and the merged folder alone."""
    trainer, _ = lm_train(tiny_gpt_oss, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = {n.split(".lora_")[0].split(".layers.")[1] for n in trained_only_adapters(trainer)}
    layers = trainer.model.config.num_hidden_layers
    assert adapted == {f"{i}.self_attn.{p}" for i in range(layers) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    check_peft_and_merged(trainer, tiny_gpt_oss, tmp_path / "run" / "export")


def test_lora_on_the_fused_experts_step_one_equals_stock_peft(tiny_gpt_oss, tmp_path):
    """LoRA on the fused experts ([E, H, 2I] / [E, I, H]): Spindle's step-1 loss, aux loss and grad norm equal
    stock transformers + stock PEFT (`target_parameters`) with the same initial adapters (1e-5)."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import STEP_ONE_TEXT, check_step_one

    lora = '{"rank": 4, "alpha": 8, "targets": ["experts.gate_up_proj", "experts.down_proj"]}'
    metrics = one_step_metrics(tiny_gpt_oss, [STEP_ONE_TEXT], tmp_path, seq_len=32, train__lora=lora)
    model = stock_peft_experts(tiny_gpt_oss, seed=0, rank=4, alpha=8)
    check_step_one(get_family("gpt_oss"), tiny_gpt_oss, metrics, model=model)


@pytest.mark.slow
def test_expert_lora_ep2_equals_one_process(tiny_gpt_oss, lm_corpus, tmp_path):
    """LoRA on the fused experts (weights [E, H, 2I] / [E, I, H], held stacked by expert) and on q_proj, the
    experts, their biases and their adapters split over ep=2: the same losses, aux losses, grad norms and
    exported PEFT adapters as one process (as tests/distributed/test_moe_distributed.py for Qwen3-MoE)."""
    from tests.conftest import assert_same_lora_run, lm_train_cli
    from tests.distributed.test_moe_distributed import EXPERT_LORA

    lm_train_cli(tiny_gpt_oss, lm_corpus, tmp_path / "one", 1, **EXPERT_LORA)
    lm_train_cli(tiny_gpt_oss, lm_corpus, tmp_path / "ep2", 2, **EXPERT_LORA, parallel__ep=2)
    assert_same_lora_run(tmp_path / "one", tmp_path / "ep2")


def _text(tmp_path: Path) -> Path:
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"the red circle moves left {i} ."}) + "\n" for i in range(16)))
    return data
