"""`--nproc N` re-launches the same command under torchrun; workers never re-launch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spindle.distributed.launch import maybe_relaunch, strip_nproc, torchrun_command

PROBE = """
import json, os, sys
from pathlib import Path
out = Path(sys.argv[sys.argv.index("--out") + 1])
rank = os.environ["RANK"]
(out / f"rank{rank}.json").write_text(json.dumps({"world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:]}))
sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]) if "--exit" in sys.argv and rank == "1" else 0)
"""


def test_strip_nproc():
    assert strip_nproc(["train", "c.yaml", "--nproc", "4", "--x", "1"]) == ["train", "c.yaml", "--x", "1"]
    assert strip_nproc(["train", "--nproc=4", "c.yaml"]) == ["train", "c.yaml"]
    cmd = torchrun_command(2, ["train", "c.yaml", "--nproc", "2"])
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "spindle",
        "train",
        "c.yaml",
    ]


def test_no_relaunch_for_one_process_or_inside_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert maybe_relaunch(1, ["train", "c.yaml"]) is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert maybe_relaunch(2, ["train", "c.yaml", "--nproc", "2"]) is None  # a worker: go on, don't recurse
    with pytest.raises(ValueError, match="--nproc must be a positive integer"):
        maybe_relaunch(0, [])


@pytest.mark.slow
def test_relaunch_runs_n_workers_and_returns_exit_code(tmp_path, monkeypatch):
    (tmp_path / "spindle_launch_probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    out.mkdir()
    rc = maybe_relaunch(2, ["--out", str(out), "--nproc", "2"], module="spindle_launch_probe")
    assert rc == 0
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen == {"world": "2", "argv": ["--out", str(out)]}
    # A failing worker makes the launcher (and so `spindle ... --nproc N`) exit non-zero.
    assert maybe_relaunch(2, ["--out", str(out), "--exit", "3", "--nproc=2"], module="spindle_launch_probe") != 0


@pytest.mark.slow
def test_python_m_spindle_runs_under_torchrun():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "spindle",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("usage: spindle") == 2  # both workers ran the CLI
