"""Exports in the checkpoint's precision (`export.dtype`): a bf16 checkpoint fine-tuned comes back bf16,
tensor for tensor as the input stored it, and loads in stock diffusers / transformers."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from spindle.api import load_job_config, make_trainer
from spindle.export.dtypes import stored_float_dtypes
from tests.conftest import lm_train, train_overrides

LORA = "{rank: 4, alpha: 8}"


@pytest.fixture(scope="module")
def bf16_qwen3(tiny_qwen3, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("bf16") / "qwen3"
    AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.bfloat16).save_pretrained(root)
    AutoTokenizer.from_pretrained(tiny_qwen3).save_pretrained(root)
    return root


def _wan_train(model, data, out, **overrides):
    trainer = make_trainer(
        load_job_config(
            None, train_overrides(model, data, out, train__max_steps=2, train__global_batch_size=2, **overrides)
        )
    )
    return trainer, trainer.run()


def test_bf16_dit_full_export_keeps_each_tensors_dtype_and_loads_in_stock_diffusers(bf16_wan, shapes_videos, tmp_path):
    from diffusers import WanPipeline

    trainer, result = _wan_train(bf16_wan, shapes_videos, tmp_path / "run")
    source = stored_float_dtypes(bf16_wan / "transformer")
    written = stored_float_dtypes(result.export_dir / "transformer")
    assert written == source
    exported = load_file(result.export_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    changed = 0
    for name, value in trainer.model.state_dict().items():
        want = value.detach().to(source[name])
        assert torch.equal(exported[name], want), name
        changed += not torch.equal(
            want, load_file(bf16_wan / "transformer" / "diffusion_pytorch_model.safetensors")[name]
        )
    assert changed, "training changed no exported tensor"
    pipe = WanPipeline.from_pretrained(result.export_dir, dtype=torch.bfloat16)
    assert pipe.transformer.dtype == torch.bfloat16

    # `spindle export --dtype float32` of the same checkpoint: every tensor fp32, equal to the trained one
    from spindle.cli import main

    out = tmp_path / "fp32"
    # the offline export streams the checkpoint: it never builds (loads) the transformer
    with mock.patch("diffusers.ModelMixin.from_pretrained", side_effect=AssertionError("model built")):
        assert main(["export", str(result.output_dir), "--out", str(out), "--dtype", "float32"]) == 0
    fp32 = load_file(out / "transformer" / "diffusion_pytorch_model.safetensors")
    for name, value in trainer.model.state_dict().items():
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], value.detach()), name


def test_bf16_dit_lora_export_is_bf16_and_loads_in_stock_diffusers(bf16_wan, shapes_videos, tmp_path):
    from diffusers import WanPipeline

    trainer, result = _wan_train(bf16_wan, shapes_videos, tmp_path / "run", train__lora=LORA)
    lora_file = result.export_dir / "lora" / "pytorch_lora_weights.safetensors"
    adapters = load_file(lora_file)
    assert adapters and {v.dtype for v in adapters.values()} == {torch.bfloat16}
    original = load_file(result.export_dir / "lora" / "original_layout_lora.safetensors")
    assert {v.dtype for v in original.values()} == {torch.bfloat16}
    params = dict(trainer.model.named_parameters())
    name = next(k for k in adapters if ".lora_A." in k)
    trained = params[name.removeprefix("transformer.").replace(".lora_A.weight", ".lora_A.default.weight")].detach()
    assert torch.equal(adapters[name], trained.to(torch.bfloat16))
    pipe = WanPipeline.from_pretrained(bf16_wan, dtype=torch.bfloat16)
    pipe.load_lora_weights(result.export_dir / "lora")
    assert pipe.transformer.dtype == torch.bfloat16

    # `spindle export` of the checkpoint writes the same adapters, also bf16
    from spindle.cli import main

    out = tmp_path / "cli"
    assert main(["export", str(result.output_dir), "--out", str(out)]) == 0
    again = load_file(out / "lora" / "pytorch_lora_weights.safetensors")
    assert again.keys() == adapters.keys() and all(torch.equal(again[k], adapters[k]) for k in adapters)


def test_bf16_llm_export_is_bf16_and_loads_in_stock_transformers(bf16_qwen3, lm_corpus, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, result = lm_train(bf16_qwen3, lm_corpus, tmp_path / "run", train__max_steps=2)
    export = result.export_dir
    written = stored_float_dtypes(export)
    assert written and set(written.values()) == {torch.bfloat16}
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(export, dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    exported = loaded.state_dict()
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(exported[key], value.detach().to(torch.bfloat16)), key
    # the trained model itself stays fp32 (master weights)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}

    # export.dtype overrides: float32 writes the trained weights exactly (`spindle export --dtype`)
    from spindle.cli import main

    out = tmp_path / "fp32"
    # the offline export streams the checkpoint: it never builds (loads) the model
    with mock.patch("transformers.PreTrainedModel.from_pretrained", side_effect=AssertionError("model built")):
        assert main(["export", str(result.output_dir), "--out", str(out), "--dtype", "float32"]) == 0
    fp32 = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(fp32.state_dict()[key], value.detach()), key


def test_export_dtype_is_checked(make_config):
    from spindle.config import ConfigError

    with pytest.raises(ConfigError, match=r"export\.dtype"):
        make_config(export__dtype="float64")
