"""`spindle precompute` + `data.precomputed`: cached conditions train like raw media, encoders stay unloaded."""

from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spindle.api import make_trainer, train
from spindle.data.precomputed import StaleCacheError
from spindle.train.metrics import read_metrics

COMMON = dict(train__max_steps=3, checkpoint__export=False)


@pytest.fixture(scope="module")
def cache(tiny_wan, shapes_videos, tmp_path_factory):
    """The tiny Wan dataset precomputed by the CLI on 2 processes."""
    from tests.conftest import run_spindle, train_overrides

    root = tmp_path_factory.mktemp("cache")
    cfg = root / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({}))
    args = train_overrides(tiny_wan, shapes_videos, root / "unused")
    proc = run_spindle("precompute", cfg, *args, "--out", root / "c", "--nproc", 2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "c"


def test_cache_holds_what_the_condition_model_computes(cache, make_config):
    from spindle.data.datasets import build_dataset, collate
    from spindle.registry import resolve_family
    from spindle.train.tasks.flow_matching import build_condition_model

    trainer_cfg = make_config()
    family = resolve_family(trainer_cfg.model.path)
    condition = build_condition_model(trainer_cfg, family, torch.device("cpu"), "no")
    data = trainer_cfg.data
    dataset = build_dataset(data.path, tuple(data.resolution), data.num_frames)
    assert len(list((cache / "samples").iterdir())) == len(dataset)
    for index in (0, 5):  # written by rank 0 and rank 1
        expected = condition.encode(collate([dataset.load(index)]))
        cached = load_file(cache / "samples" / f"{index:08d}.safetensors")
        assert cached.keys() == expected.keys()
        for key in expected:
            assert torch.equal(cached[key], expected[key][0]), key


def test_cached_training_equals_raw_training_and_skips_the_encoders(cache, make_config, tmp_path):
    train(make_config(tmp_path / "raw", **COMMON))
    trainer = make_trainer(make_config(tmp_path / "cached", data__precomputed=cache, **COMMON))
    pipe = trainer.task.condition.pipe
    assert pipe.text_encoder is None and pipe.tokenizer is None
    assert all(p.is_meta for p in pipe.vae.parameters()), "the VAE's weights were loaded"
    trainer.run()
    for key in ("loss", "grad_norm"):
        raw = [m[key] for m in read_metrics(tmp_path / "raw")]
        cached = [m[key] for m in read_metrics(tmp_path / "cached")]
        assert cached == pytest.approx(raw, rel=1e-6, abs=0), key


def test_mismatched_settings_are_refused(cache, make_config):
    cfg = make_config(data__precomputed=cache, model__max_text_length=24, **COMMON)
    with pytest.raises(StaleCacheError, match="max_text_length: cache 16, this run 24"):
        make_trainer(cfg)


def test_a_cache_made_by_an_older_encoding_is_refused(cache, make_config, monkeypatch):
    """A family whose `encode` changed bumps its condition model's `encoding_version`; caches made before
    are refused naming it, not read as current."""
    from spindle.models.wan.condition import WanConditionModel

    monkeypatch.setattr(WanConditionModel, "encoding_version", 2)
    cfg = make_config(data__precomputed=cache, **COMMON)
    with pytest.raises(StaleCacheError, match="encoding: cache 1, this run 2"):
        make_trainer(cfg)


def test_cache_from_another_checkpoint_is_refused(cache, make_config, tmp_path):
    from spindle.models.wan.tiny import build_tiny as build_tiny_wan

    other = build_tiny_wan(tmp_path / "other", seed=1)
    cfg = make_config(model__path=other, data__precomputed=cache, **COMMON)
    with pytest.raises(StaleCacheError, match=r"comes from another checkpoint.*checkpoint: cache"):
        make_trainer(cfg)


def test_changed_sample_is_refused(cache, shapes_videos, make_config, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shapes_videos, data)
    cfg = make_config(data__path=data, data__precomputed=cache, **COMMON)
    with pytest.raises(StaleCacheError, match="samples changed since the cache was made"):
        make_trainer(cfg)


def test_unfinished_cache_is_refused(make_config, tmp_path):
    (tmp_path / "c" / "samples").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"manifest\.json not found.*spindle precompute"):
        make_trainer(make_config(data__precomputed=tmp_path / "c", **COMMON))


def test_a_damaged_cache_file_is_named(cache, make_config, tmp_path):
    damaged = tmp_path / "c"
    shutil.copytree(cache, damaged)
    for sample in (damaged / "samples").iterdir():  # every one: whichever the loader reads first
        sample.write_bytes(sample.read_bytes()[:100])
    with pytest.raises(StaleCacheError, match=r"samples/\d{8}\.safetensors is damaged or missing .*spindle precompute"):
        train(make_config(tmp_path / "run", data__precomputed=damaged, **COMMON))
