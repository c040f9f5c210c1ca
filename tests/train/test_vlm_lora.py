"""LoRA on a VLM's vision tower and aligner (`train.lora.parts`, spindle/train/tasks/vlm_lora.py): step 1 equals
stock transformers + stock PEFT on the same modules with the same initial adapters, only adapters train, the
PEFT folder loads in stock `PeftModel.from_pretrained` with the trained logits and merges; it composes with
`train.freeze`; a text-only micro-batch gives the vision adapters a zero gradient, and on 2 processes (one rank
text-only) and under vision-tower SP the run equals one process."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.api import check_job_plan, load_job_config, make_trainer
from spindle.config import ConfigError
from spindle.registry import get_family
from spindle.testing import vlm_conformance as suite
from tests.conftest import lm_overrides, spindle_train, vlm_overrides, vlm_train
from tests.train.test_lm_lora import check_vlm_lora_export, trained_only_adapters

ALL_PARTS = '["vision", "aligner", "language"]'
# stock PEFT's target_modules (a regex over full module names), written from the transformers modules: each
# part's linear layers as train.lora.parts documents them
STOCK_TARGETS = {
    "language": r"model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)",
    "vision": r"model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate_proj|up_proj|down_proj|linear_fc[12]))",
    "aligner": r"model\.visual\.(merger|deepstack_merger_list\.\d+)\.(mlp\.\d+|linear_fc[12])",
}
# a family's own module names: Gemma 3's SigLIP encoder layers
FAMILY_TARGETS = {
    "gemma3_vl": {"vision": r"model\.vision_tower\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])"}
}


def lora(parts: list[str], **extra) -> str:
    return json.dumps({"rank": 4, "alpha": 8, "parts": parts, **extra})


def adapted_modules(model: torch.nn.Module) -> set[str]:
    return {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_A." in n}


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("qwen2_5_vl", ["language", "vision"]),
        ("qwen3_vl", ["vision", "aligner"]),
        ("gemma3_vl", ["language", "vision"]),
    ],
    ids=["qwen2_5_vl-language+vision", "qwen3_vl-vision+aligner", "gemma3_vl-language+vision"],
)
def test_vision_lora_step_one_equals_stock_peft(name, parts, tiny_checkpoint, vlm_conversations, tmp_path):
    """Step 1's loss and grad norm (the adapters' gradients) equal stock transformers + stock `get_peft_model`
    targeting the same modules (a regex written from the transformers modules) with the same initial adapters
    (`init_adapters` keyed on the module names), both at 1e-5; every base weight is frozen, whatever part."""
    from peft import LoraConfig, get_peft_model

    from spindle.train.lora import init_adapters

    root = tiny_checkpoint(name)
    data = suite.subset(vlm_conversations, tmp_path / "data", [0])
    trainer, _ = vlm_train(
        root, data, tmp_path / "run", data__packing=False, train__max_steps=1, train__lora=lora(parts)
    )
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    trained_only_adapters(trainer)
    assert all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)  # no base weight

    targets = "|".join({**STOCK_TARGETS, **FAMILY_TARGETS.get(name, {})}[p] for p in parts)
    stock = get_peft_model(suite.stock_model(root), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    init_adapters(stock.base_model.model, trainer.cfg.train.seed)
    assert adapted_modules(stock.base_model.model) == adapted_modules(trainer.model)
    family = get_family(name)
    assert {family.part_of(m + ".") for m in adapted_modules(trainer.model)} == set(parts)
    suite.check_step_one(family, root, data, logged, model=stock)
    assert logged["grad_norm"] == pytest.approx(suite.grad_norm(stock), rel=1e-5)  # tighter than the suite's 1e-4


def test_vision_lora_with_everything_frozen_exports_what_stock_peft_loads(
    tiny_qwen2_5_vl, vlm_conversations, tmp_path, spindle_cli
):
    """`train.freeze` of every part with adapters on all three (language, vision blocks, merger): only the
    adapters have optimizer state, stock `PeftModel.from_pretrained(AutoModelForImageTextToText...)` gives the
    trained logits on an image conversation and the merged folder the same; `spindle export` of the checkpoint
    writes the same adapters."""
    from safetensors.torch import load_file

    adapted = check_vlm_lora_export(
        tiny_qwen2_5_vl,
        vlm_conversations,
        tmp_path,
        lora(["language", "vision", "aligner"]),
        parts={"language", "vision", "aligner"},
        train__freeze=ALL_PARTS,
    )
    assert any(".visual.blocks.0.attn.qkv." in n for n in adapted)
    assert any(".visual.merger.mlp.0." in n for n in adapted)
    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    a, b = (
        load_file(d / "lora" / "adapter_model.safetensors") for d in (tmp_path / "run" / "export", tmp_path / "cli")
    )
    assert any(".visual.blocks." in k for k in a) and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_vision_lora_exports_what_stock_peft_loads(name, tiny_checkpoint, vlm_conversations, tmp_path):
    """Qwen3-VL's tower (deepstack mergers beside the merger), over a dense and an MoE decoder: adapters on the
    vision blocks and the language model load in stock PEFT and merge."""
    adapted = check_vlm_lora_export(
        tiny_checkpoint(name),
        vlm_conversations,
        tmp_path,
        lora(["language", "vision"]),
        parts={"language", "vision"},
    )
    assert any(".visual.blocks.0.mlp.linear_fc1." in n for n in adapted)


@pytest.mark.parametrize("name", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_omni_thinker_lora_on_every_part_loads_in_stock_peft(name, tiny_checkpoint, omni_conversations, tmp_path):
    """The omni thinkers (the same VLM code): adapters on the audio encoder's layers, the vision blocks, the
    aligners (vision merger, audio projection) and the decoder, every base weight frozen; stock PEFT loads the
    folder onto the stock thinker with the trained logits on an image + audio conversation (1e-5)."""

    from spindle.testing import omni_conformance as omni_suite
    from tests.conftest import omni_train

    family = get_family(name)
    root = tiny_checkpoint(name)
    data = suite.subset(omni_conversations, tmp_path / "data", [2])  # an image, then an audio clip
    parts = ["audio", "vision", "aligner", "language"]
    trainer, _ = omni_train(root, data, tmp_path / "run", train__max_steps=2, train__lr=1e-2, train__lora=lora(parts))
    adapted = trained_only_adapters(trainer)
    assert {family.part_of(n) for n in adapted} == set(parts)
    assert any(n.startswith("model.audio_tower.layers.0.") for n in adapted)
    assert any(n.startswith("model.visual.blocks.0.attn.") for n in adapted)  # qkv, or q/k/v (Qwen2.5-Omni)
    omni_suite.check_thinker_peft_export(family, root, data, trainer, tmp_path / "run" / "export" / "lora")


def test_text_only_batch_gives_the_vision_adapters_a_zero_gradient(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    """A micro-batch with no image runs the vision tower's dummy forward through its adapters (what keeps
    FSDP2's collectives in step): each vision adapter gets a gradient, all zeros; the base stays without one."""
    data = suite.subset(vlm_conversations, tmp_path / "data", [0, 3])  # line 3 is text-only
    overrides = vlm_overrides(
        tiny_qwen2_5_vl, data, tmp_path / "run", data__packing=False, train__lora=lora(["language", "vision"])
    )
    trainer = make_trainer(load_job_config(None, overrides))
    next(trainer.loader)
    batch = next(trainer.loader)
    assert "pixel_values" not in batch
    trainer.task.forward(trainer.model, batch, 0).loss_sum.backward()
    params = dict(trainer.model.named_parameters())
    vision = {n: p for n, p in params.items() if n.startswith("model.visual.blocks.") and ".lora_" in n}
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision.values())
    assert all(p.grad is None for n, p in params.items() if ".lora_" not in n)
    language_b = [p for n, p in params.items() if n.startswith("model.language_model.") and ".lora_B." in n]
    assert any(p.grad.any() for p in language_b)  # the text itself trains the language adapters


def test_lora_parts_and_freeze_errors_name_the_key(tiny_qwen2_5_vl, tiny_qwen3, lm_corpus, vlm_conversations, tmp_path):
    """Bad `train.lora.parts` (an unknown name, a part the family lacks, targets matching none of a part's
    layers), a `train.freeze` that leaves a part neither frozen nor adapted, and `parts` on a text-only model are
    config errors naming the key and the valid values, raised before any weight is read."""

    def config(model=tiny_qwen2_5_vl, data=vlm_conversations, **values):
        return load_job_config(None, lm_overrides(model, data, tmp_path / "run", **values))

    with pytest.raises(ConfigError, match=r"train\.lora\.parts.*'audio', 'vision', 'aligner' or 'language'"):
        config(train__lora=lora(["eyes"]))
    with pytest.raises(ConfigError, match=r"train\.lora\.parts names \['audio'\], which qwen2_5_vl .* \['aligner'"):
        check_job_plan(config(train__lora=lora(["audio"])), 1)
    with pytest.raises(ConfigError, match=r"train\.freeze=\['vision'\] with train\.lora.* \['aligner'\] would stay"):
        check_job_plan(config(train__lora=lora(["language"]), train__freeze='["vision"]'), 1)
    check_job_plan(config(train__lora=lora(["language", "vision"]), train__freeze=ALL_PARTS), 1)  # composes
    check_job_plan(config(train__lora=lora(["vision"]), train__freeze='["aligner", "language"]'), 1)
    cfg = config(train__lora=lora(["language", "vision"], targets=["q_proj", "v_proj"]))
    with pytest.raises(ConfigError, match=r"'vision' gets no adapter: .* \(.*attn\.qkv.*\); add one of them"):
        make_trainer(cfg)
    with pytest.raises(ConfigError, match=r"train\.lora\.parts"):
        config(model=tiny_qwen3, data=lm_corpus, train__lora=lora(["language"]))


# ---------------------------------------------------------------- 2 processes equal one

LORA_RUN = dict(suite.REFERENCE_RUN, train__lora=lora(["language", "vision", "aligner"]), train__lr=1e-2)
LORA_LAYOUTS = ["dp_shard2_text_only_rank", "sp2"]


@pytest.fixture(scope="module")
def vision_lora_one(tiny_checkpoint, vlm_conversations, tmp_path_factory):
    data = suite.subset(vlm_conversations, tmp_path_factory.mktemp("vlm_lora_rows"), suite.REFERENCE_LINES)
    out = tmp_path_factory.mktemp("vision_lora_one") / "run"
    spindle_train(out, 1, vlm_overrides(tiny_checkpoint("qwen2_5_vl"), data, out, **LORA_RUN))
    return data, out


@pytest.mark.slow
@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_vision_lora_two_processes_equal_one(layout, vision_lora_one, tiny_checkpoint, tmp_path):
    """Adapters on the language model, the vision blocks and the merger over a frozen base: dp_shard=2 with rank 1
    seeing only text-only rows (its tower's dummy forward gives the vision adapters zero gradients and runs the
    same FSDP2 collectives: no hang), and sp=2 (vision-tower SP's hooks around the PEFT-wrapped qkv/proj), log
    the same losses and grad norms and export the same PEFT adapters as one process."""
    from safetensors.torch import load_file

    from spindle.train.metrics import read_metrics

    data, one = vision_lora_one
    two = tmp_path / "run"
    spindle_train(two, 2, vlm_overrides(tiny_checkpoint("qwen2_5_vl"), data, two, **LORA_RUN, **suite.LAYOUTS[layout]))
    ma, mb = read_metrics(one), read_metrics(two)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] and len(ma) == 2
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    adapters = "export/lora/adapter_model.safetensors"
    wa, wb = load_file(one / adapters), load_file(two / adapters)
    vision_b = [k for k in wa if ".visual.blocks." in k and ".lora_B." in k]
    assert wa.keys() == wb.keys() and vision_b and all(wa[k].abs().max() > 0 for k in vision_b)  # trained
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)
