"""`spindle export` writes only where it may (`spindle.export.target`): `--out` new, empty or an earlier
export (`--force`), never the run, the checkpoint or the base model; a full disk is one line and leaves
no partial export. As an operator runs it: the real CLI on a real run folder, a tmpfs for the full disk."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from spindle.api import load_job_config, make_trainer
from spindle.testing.multiprocess import run_spindle
from tests.conftest import train_overrides


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and modification time: what "nothing touched" compares."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def run_dir(tiny_wan, shapes_videos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export_target") / "run"
    overrides = train_overrides(
        tiny_wan, shapes_videos, out, train__max_steps=1, train__global_batch_size=2, checkpoint__export=False
    )
    make_trainer(load_job_config(None, overrides)).run()
    return out


def test_export_into_the_run_folder_is_refused_and_deletes_nothing(run_dir):
    before = snapshot(run_dir)
    proc = run_spindle("export", run_dir, "--out", run_dir)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(run_dir) in lines[0] and "run folder" in lines[0], proc.stderr
    assert snapshot(run_dir) == before
    # the checkpoint folder itself, and a folder above the run, are refused the same way
    for out, what in ((run_dir / "checkpoints", "checkpoint"), (run_dir.parent, "run folder")):
        proc = run_spindle("export", run_dir, "--out", out)
        assert proc.returncode == 2 and what in proc.stderr, proc.stderr
    assert snapshot(run_dir) == before


def test_export_into_the_checkpoints_folder_is_refused(run_dir, spindle_cli):
    """checkpoint.keep_last prunes step folders: an export made inside one would go with it."""
    for out in (run_dir / "checkpoints" / "mine", run_dir / "checkpoints" / "step-000001" / "mine"):
        r = spindle_cli("export", run_dir, "--out", out)
        assert r.returncode == 2 and "inside the run's checkpoints folder" in r.stderr, r.stderr
        assert not out.exists()


def test_export_over_a_folder_of_other_files_is_refused(run_dir, spindle_cli, tmp_path):
    out = tmp_path / "photos"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"not an export")
    (out / "sub").mkdir()
    (out / "sub" / "notes.txt").write_text("mine")
    before = snapshot(out)
    for extra in ((), ("--force",)):  # --force replaces an earlier export only
        r = spindle_cli("export", run_dir, "--out", out, *extra)
        assert r.returncode == 2 and str(out) in r.stderr and "not an earlier Spindle export" in r.stderr, r.stderr
        assert snapshot(out) == before
    assert not (tmp_path / "photos.tmp").exists()


def test_export_over_the_base_model_is_refused(run_dir, tiny_wan, spindle_cli, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_wan, base)
    before = snapshot(base)
    for extra in ((), ("--force",)):
        r = spindle_cli("export", run_dir, "--model", base, "--out", base, *extra)
        assert r.returncode == 2 and "base model" in r.stderr and str(base) in r.stderr, r.stderr
    # through a symlink too: the paths are compared resolved
    link = tmp_path / "link"
    link.symlink_to(base)
    r = spindle_cli("export", run_dir, "--model", base, "--out", link, "--force")
    assert r.returncode == 2 and "base model" in r.stderr, r.stderr
    assert snapshot(base) == before


def test_an_earlier_export_is_replaced_only_with_force(run_dir, spindle_cli, tmp_path):
    from diffusers import WanPipeline

    out = tmp_path / "exp"
    out.mkdir()  # an empty folder is fine
    assert spindle_cli("export", run_dir, "--out", out).returncode == 0
    assert json.loads((out / "spindle.json").read_text())["family"] == "wan"
    (out / "stale.txt").write_text("left from the earlier export")
    r = spindle_cli("export", run_dir, "--out", out)
    assert r.returncode == 2 and "--force" in r.stderr and str(out) in r.stderr, r.stderr
    assert (out / "stale.txt").exists()
    assert spindle_cli("export", run_dir, "--out", out, "--force").returncode == 0
    assert not (out / "stale.txt").exists() and not (tmp_path / "exp.tmp").exists()
    WanPipeline.from_pretrained(out)  # a whole pipeline again


def test_a_temporary_left_by_a_killed_export_is_named(run_dir, spindle_cli, tmp_path):
    left = tmp_path / "exp.tmp"
    left.mkdir()
    (left / "half.safetensors").write_bytes(b"\0" * 10)
    r = spindle_cli("export", run_dir, "--out", tmp_path / "exp")
    assert r.returncode == 2 and str(left) in r.stderr and "remove it" in r.stderr, r.stderr
    assert (left / "half.safetensors").exists() and not (tmp_path / "exp").exists()


def test_training_from_its_own_export_folder_is_refused_before_the_model_is_built(tiny_wan, shapes_videos, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_wan, run / "export")  # model.path = the folder the end-of-run export replaces
    before = snapshot(run / "export")
    overrides = train_overrides(run / "export", shapes_videos, run, train__max_steps=1, train__global_batch_size=2)
    with pytest.raises(ValueError, match="base model") as e:
        make_trainer(load_job_config(None, overrides))
    assert str(run / "export") in str(e.value)
    assert snapshot(run / "export") == before


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: smaller than the tiny Wan pipeline an export copies."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_one_line_with_the_bytes_needed_and_no_temporary_left(run_dir, tiny_wan, small_disk):
    from spindle.export.target import folder_bytes

    assert folder_bytes(tiny_wan) > 512 << 10, "the tiny pipeline must not fit the 512 KiB disk"
    out = small_disk / "exp"
    proc = run_spindle("export", run_dir, "--out", out)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and "[(" not in proc.stderr, proc.stderr  # no raw error list
    lines = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("spindle export: error: "), proc.stderr
    assert "No space left on device" in lines[0] and str(out) in lines[0], lines[0]
    assert f"needs about {folder_bytes(tiny_wan)} bytes" in lines[0], lines[0]
    assert list(small_disk.iterdir()) == []  # neither exp nor exp.tmp
