"""`spindle precompute` + `data.precomputed`: cached conditions train like raw media, encoders stay unloaded."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spindle.api import make_trainer, train
from spindle.data.precomputed import StaleCacheError
from spindle.train.metrics import read_metrics

COMMON = dict(train__max_steps=3, checkpoint__export=False)
# the module's cache is made by `spindle precompute --nproc 2` (a launcher and two workers): multi-process
pytestmark = pytest.mark.slow


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
    (damaged / "samples" / "00000004.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(StaleCacheError, match=r"samples/00000004\.safetensors has 100 bytes, its manifest entry"):
        make_trainer(make_config(tmp_path / "run", data__precomputed=damaged, **COMMON))


def test_every_file_is_recorded_with_its_hash_and_no_temporary_is_left(cache):
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["format"] == 2
    for entry in [*manifest["samples"], {**manifest["empty"], "file": "empty.safetensors"}]:
        data = (cache / entry["file"]).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), entry["file"]
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("how", ["swapped", "duplicated"])
def test_swapped_or_duplicated_cache_files_are_named_before_training(cache, make_config, tmp_path, how):
    """Two samples' files of the same size (one bucket): only their content tells them apart."""
    bad = tmp_path / "c"
    shutil.copytree(cache, bad)
    a, b = bad / "samples" / "00000001.safetensors", bad / "samples" / "00000002.safetensors"
    assert a.stat().st_size == b.stat().st_size
    first = a.read_bytes()
    if how == "swapped":
        a.write_bytes(b.read_bytes())
    b.write_bytes(first)
    with pytest.raises(StaleCacheError) as e:
        make_trainer(make_config(tmp_path / "run", data__precomputed=bad, **COMMON))
    named = {p.name for p in (a, b) if str(p) in str(e.value)}
    assert named == ({a.name, b.name} if how == "swapped" else {b.name}), str(e.value)
    assert "not the file its manifest entry records" in str(e.value)


def test_a_cache_too_big_to_hash_up_front_is_checked_as_it_is_read(cache, make_config, tmp_path, monkeypatch):
    from spindle.data import precomputed

    monkeypatch.setattr(precomputed, "VERIFY_BYTES", 0)
    bad = tmp_path / "c"
    shutil.copytree(cache, bad)
    for name in ("00000000", "00000003"):  # the first batch holds one of them whatever the order
        (bad / "samples" / f"{name}.safetensors").write_bytes((bad / "samples" / "00000005.safetensors").read_bytes())
    trainer = make_trainer(make_config(tmp_path / "run", data__precomputed=bad, **COMMON))  # sizes match
    with pytest.raises(StaleCacheError, match=r"samples/0000000[03]\.safetensors is not the file its manifest"):
        trainer.run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained on another sample's conditions


def test_an_interrupted_precompute_leaves_a_cache_training_refuses(cache, make_config, tmp_path, monkeypatch):
    """A precompute into an existing (complete) cache that stops part way: the old manifest is gone, so the
    mix of new and old sample files is never trained on."""
    from spindle.commands import precompute as command
    from spindle.data import precomputed

    out = tmp_path / "c"
    shutil.copytree(cache, out)
    written = []
    real = precomputed.write_sample

    def crash_after_three(root, index, conditions):
        if len(written) == 3:
            raise KeyboardInterrupt  # what Ctrl-C does mid-run
        written.append(index)
        return real(root, index, conditions)

    monkeypatch.setattr(precomputed, "write_sample", crash_after_three)
    with pytest.raises(KeyboardInterrupt):
        command.precompute(make_config(tmp_path / "unused"), out)
    assert written == [0, 1, 2] and not (out / "manifest.json").exists()
    with pytest.raises(FileNotFoundError, match=r"manifest\.json not found \(an unfinished or missing cache\)"):
        make_trainer(make_config(tmp_path / "run", data__precomputed=out, **COMMON))


def test_a_second_precompute_into_the_same_folder_is_refused(cache, make_config, tmp_path):
    from spindle.data.precomputed import cache_lock
    from tests.conftest import run_spindle, train_overrides

    out = tmp_path / "c"
    shutil.copytree(cache, out)
    before = {p.name: p.read_bytes() for p in (out / "samples").iterdir()}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("{}\n")
    cfg_args = train_overrides(Path(make_config().model.path), Path(make_config().data.path), tmp_path / "unused")
    with cache_lock(out):  # a precompute in progress (this process)
        proc = run_spindle("precompute", cfg, *cfg_args, "--out", out)
    assert proc.returncode == 2, proc.stderr
    assert f"--out {out} is being written by another spindle precompute (pid {os.getpid()})" in proc.stderr
    assert (out / "manifest.json").exists()
    assert {p.name: p.read_bytes() for p in (out / "samples").iterdir()} == before
