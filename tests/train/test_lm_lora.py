"""LoRA for the language-model tasks (spindle/train/tasks/lm_lora.py): adapters on the decoder layers only,
exported as a PEFT folder that stock peft + transformers load with the trained model's outputs, and
merged on request into a folder stock transformers loads alone."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.api import check_job_plan, load_job_config
from spindle.config import ConfigError
from spindle.testing.vlm_conformance import stock_inputs, subset
from tests.conftest import lm_overrides, lm_train, vlm_train

LORA = dict(train__lora='{"rank": 4, "alpha": 8}', train__lr=1e-2, export__merge_lora=True)


def trained_only_adapters(trainer) -> set[str]:
    states = {n for n, p in trainer.model.named_parameters() if p in trainer.optimizer.state}
    assert states and all(".lora_A." in n or ".lora_B." in n for n in states)
    return states


def test_qwen3_lora_exports_a_peft_folder_and_a_merged_model(tiny_qwen3, lm_corpus, tmp_path, spindle_cli):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, _ = lm_train(tiny_qwen3, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    trained_only_adapters(trainer)
    export = tmp_path / "run" / "export"
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30]])
    model = trainer.model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen3).eval()
        assert (ours - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapters changed the model
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(export / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    assert json.loads((export / "lora" / "adapter_config.json").read_text())["r"] == 4

    # `spindle export` of the LoRA checkpoint writes the same adapters on one process.
    from safetensors.torch import load_file

    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(d / "lora" / "adapter_model.safetensors") for d in (export, tmp_path / "cli"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_vlm_lora_adapts_the_language_model_only(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    data = subset(vlm_conversations, tmp_path / "data", [0, 1])
    trainer, _ = vlm_train(tiny_qwen2_5_vl, data, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = trained_only_adapters(trainer)
    assert all(n.startswith("model.language_model.layers.") for n in adapted)
    export = tmp_path / "run" / "export"
    (inputs,) = stock_inputs(tiny_qwen2_5_vl, subset(vlm_conversations, tmp_path / "one", [0]))
    inputs.pop("labels")
    with torch.no_grad():
        ours = trainer.model.eval()(**inputs).logits
        base = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl).eval()
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        torch.testing.assert_close(peft(**inputs).logits, ours, rtol=0, atol=1e-5)
        merged = AutoModelForImageTextToText.from_pretrained(export / "merged").eval()
        torch.testing.assert_close(merged(**inputs).logits, ours, rtol=0, atol=1e-5)
    assert (export / "lora" / "preprocessor_config.json").is_file()


def test_lora_is_refused_where_not_supported(tiny_qwen2_5_vl, lm_corpus, vlm_conversations, tmp_path):
    vlm = load_job_config(
        None, lm_overrides(tiny_qwen2_5_vl, vlm_conversations, tmp_path, train__lora="{}", train__freeze='["vision"]')
    )
    with pytest.raises(ConfigError, match=r"train\.freeze with train\.lora"):
        check_job_plan(vlm, 1)


def test_moe_lora_adapts_the_attention_and_exports_a_peft_folder(tiny_qwen3_moe, lm_corpus, tmp_path, spindle_cli):
    """A mixture-of-experts model's LoRA adapts its attention projections (its experts are fused
    parameters): stock peft + transformers load the PEFT folder with the trained model's outputs, the
    merged folder loads alone, and `spindle export` of the checkpoint writes the same adapters."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer, _ = lm_train(tiny_qwen3_moe, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained_only_adapters(trainer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    export = tmp_path / "run" / "export"
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30]])
    with torch.no_grad():
        ours = trainer.model.eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe).eval()
        assert (ours - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapters changed the model
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(export / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(d / "lora" / "adapter_model.safetensors") for d in (export, tmp_path / "cli"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_lora_on_the_fused_experts_is_refused_naming_the_targets(tiny_qwen3_moe, lm_corpus, tmp_path):
    cfg = load_job_config(
        None,
        lm_overrides(tiny_qwen3_moe, lm_corpus, tmp_path / "run", train__lora='{"rank": 4, "targets": ["experts"]}'),
    )
    with pytest.raises(ConfigError, match=r"train.lora.targets: \['experts'\] name the experts, which are fused"):
        check_job_plan(cfg, 1)
