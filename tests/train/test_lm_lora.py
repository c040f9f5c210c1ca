"""LoRA for the language-model tasks (spindle/export/peft.py): adapters on the decoder layers only,
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


def check_peft_and_merged(trainer, base_path, export) -> None:
    """The trained LoRA model's logits: changed from the base, equal to stock `PeftModel` over the base with
    `export/lora`, and the merged folder `export/merged` loaded alone gives the same logits (1e-5)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30]])
    with torch.no_grad():
        ours = trainer.model.eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_path).eval()
        assert (ours - base(input_ids=ids).logits).abs().max() > 1e-3  # the adapters changed the model
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        torch.testing.assert_close(peft(input_ids=ids).logits, ours, rtol=0, atol=1e-5)
        merged = AutoModelForCausalLM.from_pretrained(export / "merged").eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, ours, rtol=0, atol=1e-5)


def test_qwen3_lora_exports_a_peft_folder_and_a_merged_model(tiny_qwen3, lm_corpus, tmp_path, spindle_cli):
    trainer, _ = lm_train(tiny_qwen3, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    trained_only_adapters(trainer)
    export = tmp_path / "run" / "export"
    check_peft_and_merged(trainer, tiny_qwen3, export)
    assert json.loads((export / "lora" / "adapter_config.json").read_text())["r"] == 4

    # `spindle export` of the LoRA checkpoint writes the same adapters on one process.
    from safetensors.torch import load_file

    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(d / "lora" / "adapter_model.safetensors") for d in (export, tmp_path / "cli"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # `spindle export --merge` (issue 43) also writes the merged folder stock transformers loads alone
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli-merged", "--merge")
    assert r.returncode == 0, r.stderr
    check_peft_and_merged(trainer, tiny_qwen3, tmp_path / "cli-merged")


def check_vlm_lora_export(
    root, vlm_conversations, tmp_path, lora: str, parts: set[str] = frozenset({"language"}), **overrides
) -> set[str]:
    """A VLM LoRA run (`lora`: train.lora; `overrides`: more of the config) adapts the blocks of `parts` only
    (the language model's decoder layers by default); stock peft + transformers load its PEFT folder, and stock
    transformers its merged folder, with the trained model's logits (1e-5). -> the adapted parameter names."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from spindle.registry import family_of

    data = subset(vlm_conversations, tmp_path / "data", [0, 1])
    trainer, _ = vlm_train(
        root, data, tmp_path / "run", train__max_steps=2, **dict(LORA, train__lora=lora, **overrides)
    )
    adapted = trained_only_adapters(trainer)
    family = family_of(root)
    assert {family.part_of(n) for n in adapted} == parts
    assert all(".layers." in n for n in adapted if family.part_of(n) == "language")  # decoder layers, not the head
    export = tmp_path / "run" / "export"
    (inputs,) = stock_inputs(root, subset(vlm_conversations, tmp_path / "one", [0]))
    inputs.pop("labels")
    with torch.no_grad():
        ours = trainer.model.eval()(**inputs).logits
        base = AutoModelForImageTextToText.from_pretrained(root).eval()
        assert (ours - base(**inputs).logits).abs().max() > 1e-4  # the adapters changed the model
        peft = PeftModel.from_pretrained(base, export / "lora").eval()
        torch.testing.assert_close(peft(**inputs).logits, ours, rtol=0, atol=1e-5)
        merged = AutoModelForImageTextToText.from_pretrained(export / "merged").eval()
        torch.testing.assert_close(merged(**inputs).logits, ours, rtol=0, atol=1e-5)
    assert (export / "lora" / "preprocessor_config.json").is_file()
    return adapted


def test_vlm_lora_adapts_the_language_model_only(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    check_vlm_lora_export(tiny_qwen2_5_vl, vlm_conversations, tmp_path, '{"rank": 4, "alpha": 8}')


def test_vl_moe_lora_on_the_experts_loads_in_stock_peft(tiny_checkpoint, vlm_conversations, tmp_path):
    """Qwen3-VL-MoE: the same expert LoRA as Qwen3-MoE (one implementation), on its language model's fused
    experts and attention, loads in stock PEFT and merges."""
    lora = '{"rank": 4, "alpha": 8, "targets": ["q_proj", "experts"]}'
    adapted = check_vlm_lora_export(tiny_checkpoint("qwen3_vl_moe"), vlm_conversations, tmp_path, lora)
    assert any(".mlp.experts.base_layer.lora_A." in n for n in adapted)


def test_lora_is_refused_where_not_supported(tiny_qwen2_5_vl, lm_corpus, vlm_conversations, tmp_path):
    vlm = load_job_config(
        None, lm_overrides(tiny_qwen2_5_vl, vlm_conversations, tmp_path, train__lora="{}", train__freeze='["vision"]')
    )
    with pytest.raises(ConfigError, match=r"train\.freeze=\[.vision.\] with train\.lora"):
        check_job_plan(vlm, 1)


def test_moe_lora_adapts_the_attention_and_exports_a_peft_folder(tiny_qwen3_moe, lm_corpus, tmp_path, spindle_cli):
    """A mixture-of-experts model's LoRA adapts its attention projections (its experts are fused
    parameters): stock peft + transformers load the PEFT folder with the trained model's outputs, the
    merged folder loads alone, and `spindle export` of the checkpoint writes the same adapters."""
    from safetensors.torch import load_file

    trainer, _ = lm_train(tiny_qwen3_moe, lm_corpus, tmp_path / "run", train__max_steps=2, **LORA)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained_only_adapters(trainer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    export = tmp_path / "run" / "export"
    check_peft_and_merged(trainer, tiny_qwen3_moe, export)
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    a, b = (load_file(d / "lora" / "adapter_model.safetensors") for d in (export, tmp_path / "cli"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def stock_peft_experts(root, seed: int, rank: int, alpha: float):
    """Stock transformers + stock PEFT (`get_peft_model`, `target_parameters`) on the fused experts, the
    adapters initialised as Spindle initialises them for `train.seed` (`init_adapters`, keyed on the
    module names, which are the same under PEFT's `base_model.model.`)."""
    from peft import LoraConfig, get_peft_model

    from spindle.testing.causal_lm_conformance import stock
    from spindle.train.lora import init_adapters

    model = get_peft_model(stock(root)[0], LoraConfig(r=rank, lora_alpha=alpha, target_parameters=EXPERTS))
    init_adapters(model.base_model.model, seed)
    return model


def test_moe_lora_on_the_experts_step_one_equals_stock_peft(tiny_qwen3_moe, tmp_path):
    """LoRA on the fused experts: Spindle's step-1 loss, aux loss and grad norm equal stock transformers +
    stock PEFT (`target_parameters`) with the same initial adapters (1e-5)."""
    from spindle.registry import get_family
    from spindle.testing.causal_lm_conformance import STEP_ONE_TEXT, check_step_one
    from tests.conftest import one_step_metrics

    lora = '{"rank": 4, "alpha": 8, "targets": ["experts.gate_up_proj", "experts.down_proj"]}'
    metrics = one_step_metrics(tiny_qwen3_moe, [STEP_ONE_TEXT], tmp_path, seq_len=32, train__lora=lora)
    model = stock_peft_experts(tiny_qwen3_moe, seed=0, rank=4, alpha=8)
    check_step_one(get_family("qwen3_moe"), tiny_qwen3_moe, metrics, model=model)


def test_moe_lora_on_the_experts_exports_what_stock_peft_loads(tiny_qwen3_moe, lm_corpus, tmp_path, spindle_cli):
    """`train.lora.targets: [experts]` (both fused parameters) adapts only them; the PEFT folder loads in
    stock `PeftModel.from_pretrained` with the trained model's logits and the key names and config
    stock PEFT writes for the same adapters; the merged folder loads alone with the same logits; and
    `spindle export` of the checkpoint writes the same folder."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    lora = dict(LORA, train__lora='{"rank": 4, "alpha": 8, "targets": ["experts"]}')
    trainer, _ = lm_train(tiny_qwen3_moe, lm_corpus, tmp_path / "run", train__max_steps=2, **lora)
    adapted = trained_only_adapters(trainer)
    assert {n.split(".lora_")[0].split(".mlp.")[-1] for n in adapted} == {"experts", "experts.base_layer"}
    export = tmp_path / "run" / "export"
    check_peft_and_merged(trainer, tiny_qwen3_moe, export)
    # what stock PEFT's save_pretrained writes for adapters on the same parameters: the same keys and shapes
    stock = get_peft_model_state_dict(stock_peft_experts(tiny_qwen3_moe, seed=0, rank=4, alpha=8))
    ours_file = load_file(export / "lora" / "adapter_model.safetensors")
    assert {k: v.shape for k, v in ours_file.items()} == {k: v.shape for k, v in stock.items()}
    config = json.loads((export / "lora" / "adapter_config.json").read_text())
    layers = trainer.model.config.num_hidden_layers
    assert config["target_modules"] is None and len(config["target_parameters"]) == 2 * layers  # 2 per MoE layer
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    b = load_file(tmp_path / "cli" / "lora" / "adapter_model.safetensors")
    assert ours_file.keys() == b.keys() and all(torch.equal(ours_file[k], b[k]) for k in b)
    assert json.loads((tmp_path / "cli" / "lora" / "adapter_config.json").read_text()) == config


@pytest.mark.parametrize("transposed", [False, True], ids=["experts_out_in", "experts_in_out"])
def test_merging_an_expert_adapter_adds_pefts_delta(transposed):
    """`export.merge_lora` of a fused expert parameter adds what PEFT's `ParamWrapper.get_delta_weight`
    computes, in either layout a module may store its experts in (`is_transposed`: [E, in, out]); non-square
    shapes, so a mixed-up axis cannot pass."""
    from peft import LoraConfig
    from peft.tuners.lora import ParamWrapper

    from spindle.export.peft import merged_state, transposed_parameters

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.is_transposed = transposed
            self.w = torch.nn.Parameter(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)))

    model = torch.nn.Sequential(Experts())
    wrapper = ParamWrapper(model[0], "default", "w", LoraConfig(r=2, target_parameters=["w"]), r=2, lora_alpha=2)
    g = torch.Generator().manual_seed(1)
    a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    with torch.no_grad():
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(torch.randn(b.shape, generator=g))
    parameters = {"0": "0.w"}  # the adapter module -> the parameter it adapts
    layout = transposed_parameters(model, parameters)
    assert layout == ({"0.w"} if transposed else set())
    base = {"0.w": model[0].w.detach().clone()}
    merged = merged_state(base, {"0.lora_A.weight": a, "0.lora_B.weight": b}, parameters, layout)
    torch.testing.assert_close(merged["0.w"], base["0.w"] + wrapper.get_delta_weight("default"), rtol=0, atol=1e-6)


def test_moe_lora_on_the_experts_refuses_what_peft_cannot_do(tiny_qwen3_moe, lm_corpus, tmp_path):
    """Expert LoRA with dropout (PEFT's parameter adapters take none), or naming no expert parameter, is a
    config error naming the keys and the fix, raised before any weight is read."""
    from spindle.api import make_trainer

    dropout = '{"rank": 4, "dropout": 0.1, "targets": ["experts"]}'
    cfg = load_job_config(None, lm_overrides(tiny_qwen3_moe, lm_corpus, tmp_path / "drop", train__lora=dropout))
    with pytest.raises(ConfigError, match=r"train.lora.dropout=0.1: .* set train.lora.dropout: 0"):
        make_trainer(cfg)
    missing = '{"rank": 4, "targets": ["experts.up_proj"]}'
    cfg = load_job_config(None, lm_overrides(tiny_qwen3_moe, lm_corpus, tmp_path / "miss", train__lora=missing))
    with pytest.raises(ConfigError, match=r"'experts.up_proj' matches no .* closest names: .*experts.gate_up_proj"):
        make_trainer(cfg)


@pytest.mark.parametrize("transposed", [False, True], ids=["experts_out_in", "experts_in_out"])
def test_expert_major_adapters_compute_what_pefts_wrappers_compute(transposed):
    """The fused experts' adapters held stacked by expert (spindle.train.expert_lora: the layout that splits
    with the experts under parallel.ep) give the outputs and gradients of PEFT's nested `ParamWrapper`s they
    replace, under PEFT's names, and convert back to PEFT's exact tensors; either layout a module may store
    its experts in, two parameters of one module (nested wrappers), non-square shapes."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.lora import ParamWrapper

    from spindle.train.expert_lora import to_peft_layout, unwrap_param_wrappers
    from spindle.train.lora import lora_scale, wrapped_parameters

    g = torch.Generator().manual_seed(0)

    class Experts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts, self.is_transposed = 3, transposed
            w, v = torch.randn(3, 5, 7, generator=g), torch.randn(3, 4, 5, generator=g)  # [E, out, in]
            self.w = torch.nn.Parameter(w.mT.contiguous() if transposed else w)
            self.v = torch.nn.Parameter(v.mT.contiguous() if transposed else v)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [E, n, 7]
            w, v = (self.w, self.v) if transposed else (self.w.mT, self.v.mT)
            return torch.bmm(torch.bmm(x, w).tanh(), v)

    peft = torch.nn.Sequential(Experts())
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_parameters=["w", "v"]), peft)
    peft.requires_grad_(False)
    wrappers = {n: m for n, m in peft.named_modules() if isinstance(m, ParamWrapper)}
    assert set(wrappers) == {"0", "0.base_layer"}  # nested: two parameters of one module
    with torch.no_grad():
        for m in wrappers.values():
            for layer in (m.lora_A["default"], m.lora_B["default"]):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=g)).requires_grad_(True)
    ours = copy.deepcopy(peft)
    unwrap_param_wrappers(ours)
    assert type(ours[0]).__name__ == "Experts"  # the experts module back in place
    assert wrapped_parameters(ours) == {n: f"0.{m.parameter_name}" for n, m in wrappers.items()}
    assert lora_scale(ours) == {n: 1.5 for n in wrappers}
    x = torch.randn(3, 6, 7, generator=g)
    expected, got = peft(x), ours(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    (expected * x[..., :4]).sum().backward()
    (got * x[..., :4]).sum().backward()
    theirs, mine = dict(peft.named_parameters()), dict(ours.named_parameters())
    assert {n for n, p in mine.items() if p.requires_grad} == {n for n, p in theirs.items() if p.requires_grad}
    for name, p in theirs.items():
        if p.requires_grad:
            kind = name.split(".lora_")[1][0]
            assert mine[name].ndim == 3  # stacked by expert
            torch.testing.assert_close(to_peft_layout(kind, mine[name].detach()), p.detach(), rtol=0, atol=0)
            torch.testing.assert_close(to_peft_layout(kind, mine[name].grad), p.grad, rtol=0, atol=1e-5)
