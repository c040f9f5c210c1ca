"""Hugging Face repo ids where a model path is taken (`spindle.hub.resolve_model_path`): `org/name` and
`org/name@revision` resolve to the snapshot in a cache laid out as huggingface_hub lays it out
(`models--org--name/snapshots/<commit>/`, `refs/main`), with `HF_HUB_OFFLINE=1` and no network; a model
placed there trains (`spindle train` with model.path=org/name) and generates (`spindle generate --model
org/name`, `spindle.load_generator`, `spindle.DiffusionGenerator.from_pretrained`); an id not in the cache is
one line, exit 2, naming the id and the download command. Also `DiffusionGenerator.from_pretrained(DIR)`
detecting the family like `load_generator`."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from spindle.hub import parse_repo_id, resolve_model_path
from spindle.testing.multiprocess import run_spindle
from tests.conftest import train_overrides

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLDER = "fedcba9876543210fedcba9876543210fedcba98"


def place_in_cache(cache: Path, repo: str, model: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """`model` as huggingface_hub's cache holds a download of `repo` at `commit` (ref `ref` pointing at it)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    shutil.copytree(model, snapshot)
    if ref is not None:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_wan) -> tuple[Path, Path]:
    """A Hugging Face cache (HF_HUB_CACHE, offline) holding the tiny Wan as `spindle-test/tiny-wan` (main)
    and an older revision; -> (cache, main's snapshot)."""
    cache = tmp_path / "hf-cache"
    snapshot = place_in_cache(cache, "spindle-test/tiny-wan", tiny_wan)
    place_in_cache(cache, "spindle-test/tiny-wan", tiny_wan, commit=OLDER, ref=None)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, snapshot


def test_repo_ids_resolve_to_the_cached_snapshot(hub_cache, tmp_path, monkeypatch):
    cache, snapshot = hub_cache
    assert Path(resolve_model_path("spindle-test/tiny-wan")) == snapshot
    assert Path(resolve_model_path(f"spindle-test/tiny-wan@{OLDER}")) == cache / snapshot.parent / OLDER
    # HF_HOME/hub is the cache when HF_HUB_CACHE is unset
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    home_snapshot = place_in_cache(tmp_path / "home" / "hub", "other/model", snapshot)
    assert Path(resolve_model_path("other/model")) == home_snapshot
    # a local folder is used as it is, also when it is spelt like a repo id
    (tmp_path / "spindle-test" / "tiny-wan").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("spindle-test/tiny-wan") == "spindle-test/tiny-wan"
    assert parse_repo_id("/abs/path") is None and parse_repo_id("a/b/c") is None and parse_repo_id("name") is None


def test_an_id_not_cached_is_one_line_naming_it_and_the_download(hub_cache, tmp_path, spindle_cli):
    for command in (
        ["generate", "--model", "spindle-test/absent", "--prompt", "x", "--out", tmp_path / "a.png"],
        ["serve", "--model", "spindle-test/absent@v2"],
    ):
        r = spindle_cli(*command)
        assert r.returncode == 2, r
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "spindle-test/absent" in lines[0], r.stderr
        assert "hf download spindle-test/absent" in lines[0] and "huggingface-cli download" in lines[0], lines[0]
    assert "--revision v2" in lines[0]
    with pytest.raises(FileNotFoundError, match="hf download spindle-test/absent"):
        resolve_model_path("spindle-test/absent", "model.path")


def test_a_cached_model_trains_and_generates_offline(hub_cache, shapes_videos, tmp_path):
    """As a user would: `spindle train` with model.path=org/name, then `spindle generate --model org/name`, in
    subprocesses with HF_HUB_OFFLINE=1 and the cache in HF_HUB_CACHE."""
    out = tmp_path / "run"
    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}\n")
    overrides = train_overrides("spindle-test/tiny-wan", shapes_videos, out, train__max_steps=2)
    trained = run_spindle("train", cfg, *overrides, timeout=900)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert (out / "export" / "model_index.json").is_file()
    image = tmp_path / "frame.png"
    generated = run_spindle(
        "generate", "--model", "spindle-test/tiny-wan", "--prompt", "a red ball", "--height", "32", "--width", "32",
        "--num-frames", "1", "--steps", "2", "--seed", "1", "--out", image,
    )  # fmt: skip
    assert generated.returncode == 0, generated.stderr[-3000:]
    assert image.is_file()


def test_from_pretrained_detects_the_family_like_load_generator(hub_cache, tiny_wan):
    import spindle

    request = dict(prompt="a red ball", height=32, width=32, num_frames=1, num_inference_steps=2, seed=1)
    by_class = spindle.DiffusionGenerator.from_pretrained(tiny_wan, dtype="float32")
    by_function = spindle.load_generator("spindle-test/tiny-wan", dtype="float32")
    assert by_class.family == by_function.family == "wan"
    assert isinstance(by_function, spindle.DiffusionGenerator)
    np.testing.assert_array_equal(by_class.generate(**request).frames, by_function.generate(**request).frames)
    with pytest.raises(ValueError, match="dtyp"):  # engine options are checked before anything loads
        spindle.DiffusionGenerator.from_pretrained(tiny_wan, dtyp="float32")


def test_a_dpo_reference_model_may_be_a_cached_repo_id(tmp_path, monkeypatch, tiny_qwen3):
    """dpo.reference_model takes a repo id like model.path: resolved offline to the cached snapshot."""
    from spindle.api import load_job_config

    cache = tmp_path / "hub"
    snapshot = place_in_cache(cache, "acme/ref-qwen3", tiny_qwen3)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    cfg = load_job_config(
        None,
        [f"model.path={tiny_qwen3}", f"data.path={data}", "train.objective=dpo", "dpo.reference_model=acme/ref-qwen3"],
    )
    assert Path(cfg.dpo.reference_model).resolve() == snapshot.resolve()
