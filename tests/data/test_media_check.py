"""Media data checked up front (issue 25.3): every unusable sample of a dataset (corrupt or missing
file, missing or empty caption) is named in one report before any model is built, or skipped and
counted with data.skip_bad_samples; the scan is cached until a file or a setting changes."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from spindle.data import media_check
from spindle.data.datasets import build_dataset
from spindle.data.media_check import DataCheckError
from tests.conftest import TINY_SIZE, train_overrides


@pytest.fixture
def images(shapes_images, tmp_path) -> Path:
    """A copy of the 8-image folder: img 1 a corrupt PNG, img 2 an empty caption, img 3 no caption file."""
    folder = Path(shutil.copytree(shapes_images, tmp_path / "images"))
    pngs = sorted(folder.glob("*.png"))
    pngs[1].write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png" * 20)
    pngs[2].with_suffix(".txt").write_text("  \n")
    pngs[3].with_suffix(".txt").unlink()
    return folder


def test_every_problem_is_named_in_one_report(images):
    pngs = sorted(images.glob("*.png"))
    with pytest.raises(DataCheckError) as err:
        build_dataset(images, TINY_SIZE, 1)
    message = str(err.value)
    assert "3 of 8 sample(s) cannot be used" in message
    assert str(pngs[1]) in message
    assert f"{pngs[2].with_suffix('.txt')}: empty caption for {pngs[2].name}" in message
    assert f"{pngs[3].with_suffix('.txt')}: caption file missing for {pngs[3].name}" in message
    assert "data.skip_bad_samples=true" in message


def test_an_empty_caption_in_a_manifest_is_named(images, tmp_path):
    pngs = sorted(images.glob("*.png"))
    manifest = tmp_path / "m.jsonl"
    lines = [{"path": str(pngs[0]), "caption": "a red square"}, {"path": str(pngs[4]), "caption": " "}]
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(DataCheckError, match=rf"{pngs[4]}: empty caption in m\.jsonl"):
        build_dataset(manifest, TINY_SIZE, 1)


def test_the_scan_is_cached_until_a_file_changes(shapes_images, tmp_path, monkeypatch):
    folder = Path(shutil.copytree(shapes_images, tmp_path / "images"))
    decoded: list[Path] = []
    real = media_check.read_media
    monkeypatch.setattr(media_check, "read_media", lambda path, *a: decoded.append(path) or real(path, *a))
    build_dataset(folder, TINY_SIZE, 1)
    assert len(decoded) == 8
    build_dataset(folder, TINY_SIZE, 1)
    assert len(decoded) == 8  # nothing changed: not decoded again
    build_dataset(folder, (16, 16), 1)
    assert len(decoded) == 16  # another resolution: scanned again
    png = sorted(folder.glob("*.png"))[0]
    os.utime(png, ns=(png.stat().st_atime_ns, png.stat().st_mtime_ns + 10**9))
    build_dataset(folder, TINY_SIZE, 1)
    assert len(decoded) == 24  # a file changed: scanned again


def test_a_bad_image_folder_is_refused_before_any_model_is_built(images, tiny_flux, tmp_path, spindle_cli, monkeypatch):
    from spindle.train.tasks.flow_matching import FlowMatchingTask

    def never(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr(FlowMatchingTask, "__init__", never)
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    out = tmp_path / "run"
    overrides = train_overrides(tiny_flux, images, out, data__num_frames=1, data__resolution=list(TINY_SIZE))
    proc = spindle_cli("train", config, *overrides)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    pngs = sorted(images.glob("*.png"))
    assert str(pngs[1]) in proc.stderr and str(pngs[2].with_suffix(".txt")) in proc.stderr
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_skipped_samples_are_counted_in_the_summary(images, tiny_flux, tmp_path, spindle_cli, caplog):
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    out = tmp_path / "run"
    overrides = train_overrides(
        tiny_flux,
        images,
        out,
        data__num_frames=1,
        data__skip_bad_samples=True,
        train__max_steps=1,
        train__global_batch_size=1,
        train__micro_batch_size=1,
        checkpoint__export=False,
    )
    with caplog.at_level(logging.WARNING, logger="spindle.data.datasets"):
        proc = spindle_cli("train", config, *overrides)
    assert proc.returncode == 0, proc.stderr
    pngs = sorted(images.glob("*.png"))
    bad = [pngs[2].with_suffix(".txt").name, pngs[3].with_suffix(".txt").name, pngs[1].name]
    data = json.loads((out / "summary.json").read_text())["start"]["data"]
    assert data == {"rows": 5, "samples": 5, "skipped": 3}
    # one warning when the dataset is built (before the progress bar exists), none per sample during steps
    skips = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert skips == [f"data.skip_bad_samples: skipping 3 of 8 samples ({', '.join(bad)})"]
