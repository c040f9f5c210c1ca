"""Qwen3-VL-MoE's expert checkpoint layouts (spindle/models/shared/moe_checkpoints.py through the vlm_moe
task), beyond the conformance suite (which trains the tiny checkpoint: fused, as transformers 5.23's
`save_pretrained` writes it): Qwen's released layout (fused, transposed) and the per-expert layout load
as the same model, train, and export in the layout they came in; a tensor that fits no layout is an error
naming it, before any weight is read. (Sharded loading per EP rank: tests/distributed/test_sharded_load.py.)
"""

from __future__ import annotations

import pytest
import torch

from spindle.models.shared.moe_checkpoints import FUSED, FUSED_TRANSPOSED, PER_EXPERT
from spindle.registry import get_family
from spindle.testing.tiny import with_expert_layout
from spindle.testing.vlm_conformance import check_export, safetensors_dtypes, stock_model
from tests.conftest import vlm_train

FAMILY = "qwen3_vl_moe"


@pytest.fixture(scope="module")
def layouts(tiny_checkpoint, tmp_path_factory):
    """layout -> the tiny Qwen3-VL-MoE checkpoint in that expert layout."""
    src = tiny_checkpoint(FAMILY)
    root = tmp_path_factory.mktemp("vl_moe_layouts")
    return {
        FUSED: src,
        **{lay: with_expert_layout(FAMILY, src, root / lay, lay) for lay in (PER_EXPERT, FUSED_TRANSPOSED)},
    }


def test_each_layout_is_detected_and_loads_as_the_same_model(layouts):
    from transformers import AutoModelForImageTextToText

    from spindle.train.parts.experts import load_moe_model

    family = get_family(FAMILY)
    adapter = family.adapter()
    reference = stock_model(layouts[FUSED]).state_dict()
    transposed_keys = safetensors_dtypes(layouts[FUSED_TRANSPOSED])
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in safetensors_dtypes(layouts[PER_EXPERT])
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in transposed_keys
    for layout, path in layouts.items():
        assert adapter.layout(path) == layout
        loaded = load_moe_model(family, path).state_dict()
        assert loaded.keys() == reference.keys()
        assert all(torch.equal(loaded[k], reference[k]) for k in reference), layout
    # stock transformers reads Qwen's transposed layout (and, after Spindle's loads, still with its own mapping)
    stock = AutoModelForImageTextToText.from_pretrained(layouts[FUSED_TRANSPOSED]).state_dict()
    assert all(torch.equal(stock[k], reference[k]) for k in reference)


@pytest.mark.parametrize("layout", [FUSED_TRANSPOSED, PER_EXPERT])
def test_training_exports_the_input_layout(layout, layouts, vlm_conversations, tmp_path):
    """Sharded load of the layout, 2 steps, export: the input's tensor names and shapes; the transposed export
    loads in stock transformers with the trained weights and generates from an image. (transformers 5.23 has
    no per-expert mapping for qwen3_vl_moe: stock from_pretrained leaves a per-expert folder's experts
    random, so that export is checked against the trained weights through Spindle's adapter, which the
    layouts test proves equals stock's reading of the other layouts.)"""
    from safetensors import safe_open
    from safetensors.torch import load_file

    family = get_family(FAMILY)
    src = layouts[layout]
    trainer, result = vlm_train(src, vlm_conversations, tmp_path / "run", train__max_steps=2)
    trained = trainer.model.state_dict()
    shard = "model-00001-of-00001.safetensors"
    with safe_open(src / "model.safetensors", "pt") as a, safe_open(result.export_dir / shard, "pt") as b:
        assert set(a.keys()) == set(b.keys())
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    if layout == FUSED_TRANSPOSED:
        image = vlm_conversations.parent / "images" / "image_000.png"
        check_export(family, src, result.export_dir, trained, image)
    else:
        written = load_file(result.export_dir / shard)
        expected = family.adapter().to_layout(None, {k: v.detach() for k, v in trained.items()}, layout)
        assert all(torch.equal(written[k], expected[k]) for k in written)
    gate_up = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(trained[gate_up], stock_model(layouts[FUSED]).state_dict()[gate_up])  # experts trained


def test_an_expert_tensor_of_the_wrong_shape_is_named_before_loading(layouts, vlm_conversations, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from spindle.api import load_job_config, make_trainer
    from tests.conftest import vlm_overrides

    bad = tmp_path / "bad"
    shutil.copytree(layouts[PER_EXPERT], bad)
    weights = load_file(bad / "model.safetensors")
    key = "model.language_model.layers.1.mlp.experts.5.down_proj.weight"
    weights[key] = weights[key][:, :-1].contiguous()
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    cfg = load_job_config(None, vlm_overrides(bad, vlm_conversations, tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"{key} has shape \[64, 47\], expected \[64, 48\]"):
        make_trainer(cfg)
