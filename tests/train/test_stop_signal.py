"""SIGTERM during `spindle train` (a scheduler's preemption): the step in flight finishes, its checkpoint is saved
and verifies, the run exits 128 + SIGTERM naming what to do, and `checkpoint.resume=auto` continues from it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from spindle.distributed.checkpoint import checkpoint_step, list_checkpoints, verify_checkpoint
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, run_spindle


def test_sigterm_saves_the_step_and_the_run_resumes_from_it(tiny_qwen3, lm_corpus, tmp_path):
    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text("{}\n")
    args = lm_overrides(tiny_qwen3, lm_corpus, out, train__max_steps=10_000, checkpoint__export=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spindle", "train", str(cfg), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not ((out / "metrics.jsonl").is_file() and len(read_metrics(out)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)  # polling the metrics file the run writes: not a timed assertion
        seen = len(read_metrics(out))
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output[-2000:]
    assert "stopped by SIGTERM" in output and "checkpoint.resume=auto" in output
    (saved,) = list_checkpoints(out)
    stopped_at = checkpoint_step(saved)
    assert stopped_at >= seen and verify_checkpoint(saved) == []
    assert [m["step"] for m in read_metrics(out)] == list(range(1, stopped_at + 1))

    resumed = run_spindle(
        "train",
        cfg,
        *lm_overrides(
            tiny_qwen3,
            lm_corpus,
            out,
            train__max_steps=stopped_at + 2,
            checkpoint__resume="auto",
            checkpoint__export=False,
        ),
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [m["step"] for m in read_metrics(out)] == list(range(1, stopped_at + 3))
