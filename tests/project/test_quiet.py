"""Quiet by default: the libraries' progress bars and known-harmless warnings stay out of a command's
output unless `--verbose` asks for them (spindle.quiet)."""

from __future__ import annotations

import pytest


def spindle_fresh_env(*args: object):
    """`python -m spindle ARGS` in an environment without the library settings spindle.quiet exports (an
    earlier in-process command of this test session may have left them in os.environ): what a user runs."""
    import os
    import subprocess
    import sys

    from spindle.quiet import LIBRARY_SETTINGS

    env = {k: v for k, v in os.environ.items() if k not in LIBRARY_SETTINGS}
    return subprocess.run(
        [sys.executable, "-m", "spindle", *map(str, args)], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.mark.slow  # two fresh interpreters
def test_library_progress_bars_only_with_verbose(tmp_path):
    quiet = spindle_fresh_env("tiny-model", "qwen3", tmp_path / "a")
    verbose = spindle_fresh_env("tiny-model", "qwen3", tmp_path / "b", "--verbose")
    assert quiet.returncode == 0 and verbose.returncode == 0, quiet.stderr + verbose.stderr
    # transformers' save_pretrained prints this bar; the quiet run shows nothing of the libraries
    assert "Writing model shards" in verbose.stderr
    assert "Writing model shards" not in quiet.stderr and quiet.stderr.strip() == "", quiet.stderr


def test_harmless_warnings_are_filtered_and_others_kept(recwarn):
    import warnings

    from spindle.quiet import quiet_libraries
    from tests.conftest import library_output_restored

    with library_output_restored():
        quiet_libraries(loads_models=False)
        warnings.warn(
            "Accessing config attribute `boundary_ratio` directly via 'WanPipeline' object attribute is deprecated",
            FutureWarning,
            stacklevel=1,
        )
        warnings.warn("something Spindle does not know", UserWarning, stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["something Spindle does not know"]
