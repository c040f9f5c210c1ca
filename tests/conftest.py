"""Shared fixtures: one tiny Wan checkpoint and one synthetic video dataset per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from spindle.config import load_config

TINY_SIZE = (32, 32)
TINY_FRAMES = 9


@pytest.fixture(scope="session")
def tiny_wan(tmp_path_factory) -> Path:
    from spindle.testing.tiny import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("models") / "wan", seed=0)


@pytest.fixture(scope="session")
def shapes_videos(tmp_path_factory) -> Path:
    from spindle.testing.synthetic import make_shapes_video_dataset

    return make_shapes_video_dataset(
        tmp_path_factory.mktemp("data") / "shapes", num_videos=8, num_frames=TINY_FRAMES, size=TINY_SIZE
    )


def train_overrides(model: Path, data: Path, output_dir: Path, **train) -> list[str]:
    """Dotted overrides for a short CPU training run on the tiny model."""
    values = {
        "model.path": model,
        "model.max_text_length": 16,
        "data.path": data,
        "data.resolution": list(TINY_SIZE),
        "data.num_frames": TINY_FRAMES,
        "train.output_dir": output_dir,
        "train.max_steps": 6,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 2,
        "train.lr": 1e-3,
        "checkpoint.resume": "none",
    }
    values.update({k.replace("__", "."): v for k, v in train.items()})
    return [f"{k}={v}" for k, v in values.items()]


@pytest.fixture
def make_config(tiny_wan, shapes_videos, tmp_path):
    def make(output_dir: Path | None = None, **overrides):
        return load_config(None, train_overrides(tiny_wan, shapes_videos, output_dir or tmp_path / "run", **overrides))

    return make


def run_spindle(*args, timeout: float = 600):
    """`python -m spindle ARGS...` in a subprocess (this tree's code via PYTHONPATH); -> CompletedProcess."""
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "spindle", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )
