"""Speed options from the command line: `spindle generate --cache fbc` reports the PSNR against
the uncached result. (The first-block cache's exactness at threshold 0, its skipping and per-request
reset, and regional compile against eager run for every family in tests/conformance/test_conformance.py:
test_step_cache_threshold_zero_is_exact, test_step_cache_large_threshold_skips_blocks,
test_regional_compile_matches_eager.)"""

from __future__ import annotations

import subprocess
import sys


def test_cli_cache_reports_psnr(tiny_wan, tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "spindle",
            "generate",
            "--model",
            str(tiny_wan),
            "--prompt",
            "a boat",
            "--height",
            "32",
            "--width",
            "32",
            "--num-frames",
            "5",
            "--steps",
            "3",
            "--seed",
            "0",
            "--cache",
            "fbc",
            "--cache-threshold",
            "0.5",
            "--quiet",
            "--out",
            str(tmp_path / "c.mp4"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "PSNR" in r.stdout and "dB vs uncached" in r.stdout
