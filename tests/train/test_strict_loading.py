"""Strict weight loading (issue 24.3): a checkpoint whose tensors do not match the model is refused
before training, naming the tensor, on both load paths (sharded and whole-model); a forced
`model.family` that does not serve the checkpoint is refused before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from spindle.api import load_job_config, make_trainer
from spindle.distributed.sharded_load import CheckpointMismatchError
from tests.conftest import lm_overrides, train_overrides


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_dense_config_with_two_more_layers_than_weights_is_refused(sharded, tiny_qwen3, lm_corpus, tmp_path):
    model = tmp_path / "qwen3"
    shutil.copytree(tiny_qwen3, model)
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    edit_json(
        model / "config.json",
        num_hidden_layers=layers + 2,
        layer_types=config["layer_types"] + config["layer_types"][:2],
    )
    overrides = lm_overrides(model, lm_corpus, tmp_path / "run", model__sharded_load=sharded)
    with pytest.raises(CheckpointMismatchError, match=rf"tensor model\.layers\.{layers}\.\S+ .*is missing"):
        make_trainer(load_job_config(None, overrides))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before the first step


@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "full"])
def test_dit_checkpoint_with_a_missing_or_unexpected_tensor_is_refused(sharded, tiny_wan, shapes_videos, tmp_path):
    model = tmp_path / "wan"
    shutil.copytree(tiny_wan, model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    removed = "blocks.1.ffn.net.2.weight"
    state.pop(removed)
    save_file(state, weights)
    overrides = train_overrides(model, shapes_videos, tmp_path / "run", model__sharded_load=sharded)
    with pytest.raises(CheckpointMismatchError, match=rf"tensor {removed} of WanTransformer3DModel is missing"):
        make_trainer(load_job_config(None, overrides))

    shutil.copy(tiny_wan / "transformer" / "diffusion_pytorch_model.safetensors", weights)
    state = load_file(weights)
    state["blocks.0.extra.weight"] = state["blocks.0.ffn.net.2.weight"].clone()
    save_file(state, weights)
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint tensor blocks\.0\.extra\.weight is not a parameter"):
        make_trainer(load_job_config(None, overrides))


def test_forced_family_that_does_not_serve_the_checkpoint_is_refused(tiny_wan, lm_corpus, tmp_path, spindle_cli):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32}))
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    res = spindle_cli("train", config, *lm_overrides(gpt2, lm_corpus, tmp_path / "run"), "model.family=qwen3")
    assert res.returncode == 2, res.stderr
    assert "model.family=qwen3" in res.stderr and "model_type 'gpt2'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1

    res = spindle_cli("train", config, *lm_overrides(tiny_wan, lm_corpus, tmp_path / "run"), "model.family=flux")
    assert res.returncode == 2, res.stderr
    assert "model.family=flux" in res.stderr and "WanPipeline" in res.stderr
