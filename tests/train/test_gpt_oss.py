"""GPT-OSS (spindle/models/gpt_oss): what the registry-parametrised conformance suite does not check by family
name. Its tokenizer carries the harmony tokens and a harmony chat template; attention is transformers' eager
(the sinks), sdpa/varlen refused naming why (Ulysses SP with the sinks: the conformance suite's `sp2`); expert parallelism splits the fused experts with
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


def test_grpo_samples_scores_and_updates(tiny_checkpoint, tmp_path):
    """GRPO on GPT-OSS (generation with eager attention, sinks and sliding windows; the update with the router aux
    loss): the dense families' GRPO check (tests/train/test_dense_lm_families.py) run on it. (Reward modelling
    is refused for MoE families with the reason, spindle/train/objectives/reward.py.)"""
    from tests.train.test_dense_lm_families import test_grpo_trains_and_logs_each_sampled_completion as check

    check("gpt_oss", tiny_checkpoint, tmp_path)


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


# ---------------------------------------------------------------- MXFP4 checkpoints (as released)


def mxfp4_checkpoint(src: Path, out: Path, seed: int = 0) -> Path:
    """`src` (a tiny fused gpt_oss folder) in the released layout: each expert weight as random MXFP4 blocks and
    scales (`{name}_blocks` uint8 [E, out, in/32, 16], `{name}_scales` uint8 [E, out, in/32]: exponents around
    2^-6, so the dequantised weights are of the tiny model's scale), every other tensor bf16, config.json's
    quantization_config as openai/gpt-oss-20b's."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, value in load_file(src / "model.safetensors").items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, rows_in, cols_out = value.shape  # the model's [E, in, out]
            blocks = (experts, cols_out, rows_in // 32, 16)
            tensors[f"{key}_blocks"] = torch.randint(0, 256, blocks, generator=g, dtype=torch.uint8)
            tensors[f"{key}_scales"] = torch.randint(118, 124, blocks[:-1], generator=g, dtype=torch.uint8)
        else:
            tensors[key] = value.to(torch.bfloat16)
    (out / "model.safetensors").unlink()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def stock_dequantised(path: Path):
    """Stock transformers' own load of an MXFP4 folder, dequantised (`Mxfp4Config(dequantize=True)`), fp32."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    config = Mxfp4Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config)


@pytest.fixture(scope="module")
def tiny_mxfp4(tiny_gpt_oss, tmp_path_factory) -> Path:
    return mxfp4_checkpoint(tiny_gpt_oss, tmp_path_factory.mktemp("mxfp4") / "gpt_oss_mxfp4")


def test_mxfp4_layout_is_recognised_and_a_missing_scale_is_named(tiny_gpt_oss, tiny_mxfp4, tmp_path):
    from safetensors.torch import load_file, save_file

    from spindle.models.gpt_oss.conversion import ADAPTER, MXFP4
    from spindle.models.shared.moe_checkpoints import ExpertCheckpointError

    assert ADAPTER.layout(tiny_mxfp4) == MXFP4
    broken = mxfp4_checkpoint(tiny_gpt_oss, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ExpertCheckpointError, match=r"model.layers.1.mlp.experts.down_proj_scales is missing"):
        ADAPTER.layout(broken)


def test_mxfp4_sharded_reads_equal_transformers_dequantisation(tiny_mxfp4):
    """The sharded load's sources of an MXFP4 folder read transformers' dequantised weights exactly, whole and
    by region (a rank's experts and a slice of rows)."""
    from spindle.distributed.sharded_load import SafetensorsCheckpoint
    from spindle.models.gpt_oss.conversion import ADAPTER

    sources = ADAPTER.load_sources(SafetensorsCheckpoint(tiny_mxfp4).sources())
    stock = stock_dequantised(tiny_mxfp4).state_dict()
    assert not any(k.endswith(("_blocks", "_scales")) for k in sources)
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        shape, read = sources[key]
        assert shape == tuple(stock[key].shape)
        torch.testing.assert_close(read(tuple(slice(0, n) for n in shape)), stock[key], rtol=0, atol=0)
        region = (slice(2, 6), slice(8, 40), slice(1, shape[2]))
        torch.testing.assert_close(read(region), stock[key][region], rtol=0, atol=0)


@pytest.mark.parametrize("sharded_load", [True, False], ids=["sharded_load", "full_load"])
def test_mxfp4_trains_dequantised_and_exports_bf16_that_stock_loads(sharded_load, tiny_mxfp4, tmp_path, spindle_cli):
    """Step 1 on the MXFP4 folder equals stock transformers' on its own dequantised load (loss, aux loss, grad
    norm 1e-5), on both load paths; the export holds the fused expert tensors in the input's bf16 (the trained
    weights) and no quantization_config, stock transformers loads it and generates, and `spindle export` of the
    checkpoint writes the same."""
    from safetensors import safe_open

    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import STEP_ONE_TEXT, check_step_one
    from spindle.train.metrics import read_metrics

    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": STEP_ONE_TEXT}) + "\n")
    trainer, _ = lm_train(
        tiny_mxfp4, data, tmp_path / "run", data__packing=False, data__seq_len=32, train__max_steps=1,
        train__global_batch_size=1, train__micro_batch_size=1, model__sharded_load=sharded_load,
    )  # fmt: skip
    check_step_one(
        get_family("gpt_oss"), tiny_mxfp4, read_metrics(tmp_path / "run")[0], model=stock_dequantised(tiny_mxfp4)
    )
    export = tmp_path / "run" / "export"
    assert "quantization_config" not in json.loads((export / "config.json").read_text())
    key = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(next(export.glob("*.safetensors"))), framework="pt") as f:
        assert not any(k.endswith(("_blocks", "_scales")) for k in f.keys())
        exported = f.get_tensor(key)
    assert exported.dtype == torch.bfloat16
    trained = dict(trainer.model.named_parameters())[key].detach()
    torch.testing.assert_close(exported, trained.to(torch.bfloat16), rtol=0, atol=0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export)
    assert torch.equal(model.state_dict()[key], exported)
    ids = AutoTokenizer.from_pretrained(export)(STEP_ONE_TEXT, return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    # `spindle export` of the checkpoint (streamed from it, no model built) writes the same folder
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    assert "quantization_config" not in json.loads((tmp_path / "cli" / "config.json").read_text())
    with safe_open(str(next((tmp_path / "cli").glob("*.safetensors"))), framework="pt") as f:
        assert torch.equal(f.get_tensor(key), exported)


def test_lora_on_an_mxfp4_base_exports_a_merged_folder_stock_loads_whole(tiny_mxfp4, lm_corpus, tmp_path):
    """LoRA on attention over an MXFP4 base: the merged folder holds plain tensors under the model's names (not
    transformers' `{name}_blocks` it would write back after a dequantising load) and no quantization_config;
    stock transformers loads it with nothing missing, the experts exactly stock's dequantised base, the attention
    merged (changed)."""
    from transformers import AutoModelForCausalLM

    lm_train(tiny_mxfp4, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    merged = tmp_path / "run" / "export" / "merged"
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got, base = model.state_dict(), stock_dequantised(tiny_mxfp4).state_dict()
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.{name}"
        torch.testing.assert_close(got[key], base[key], rtol=0, atol=0)
    key = "model.layers.1.self_attn.q_proj.weight"
    assert (got[key] - base[key]).abs().max() > 1e-4


@pytest.mark.slow
def test_mxfp4_ep2_equals_one_process(tiny_mxfp4, lm_corpus, tmp_path):
    """An MXFP4 folder under ep=2: each rank dequantises only its own experts' blocks (the sharded load's
    regions), and the run (losses, aux losses, grad norms, export) equals one process on the same folder (the
    exports in fp32: a bf16 rounding of the layouts' float noise could differ by one bf16 step)."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import REFERENCE_RUN, check_same_run
    from tests.conftest import lm_train_cli

    run = dict(REFERENCE_RUN, export__dtype="float32")
    lm_train_cli(tiny_mxfp4, lm_corpus, tmp_path / "one", 1, **run)
    lm_train_cli(tiny_mxfp4, lm_corpus, tmp_path / "ep2", 2, **run, parallel__ep=2)
    check_same_run(get_family("gpt_oss"), tmp_path / "one", tmp_path / "ep2")
