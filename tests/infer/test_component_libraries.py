"""Which libraries a model_index.json component may come from: diffusers, transformers, and a diffusers pipeline's own
module (LTX-2's `["ltx2", "LTX2TextConnectors"]`, resolved as diffusers resolves it, `diffusers.pipelines.ltx2`);
anything else is refused naming the component and the library, before any file is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.infer.pipeline import load_component, pipeline_module


def test_a_pipeline_module_resolves_as_diffusers_resolves_it():
    import diffusers.pipelines.ltx2

    assert pipeline_module("ltx2") is diffusers.pipelines.ltx2
    assert pipeline_module("no_such_pipeline") is None
    assert pipeline_module("os.path") is None  # a dotted name is no pipeline module


def test_the_ltx2_connectors_load_from_their_pipeline_module(tiny_checkpoint):
    root = tiny_checkpoint("ltx2")
    connectors = load_component(root, "connectors", ["ltx2", "LTX2TextConnectors"], torch.device("cpu"), torch.float32)
    assert type(connectors).__name__ == "LTX2TextConnectors" and not connectors.training
    assert not any(p.requires_grad for p in connectors.parameters())


def test_another_library_is_refused_naming_it(tmp_path: Path):
    with pytest.raises(ValueError, match=r"component 'vae' comes from library 'mylib'; Spindle loads"):
        load_component(tmp_path, "vae", ["mylib", "MyVAE"], torch.device("cpu"), torch.float32)
