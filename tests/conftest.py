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


# ---------------------------------------------------------------- language models


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    from spindle.testing.tiny_llm import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    from spindle.testing.tiny_llm import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Tiny Qwen3-MoE (8 experts, top-2, per-expert layout), 2 layers; an aux coefficient large enough
    that a wrong aux loss shows in the step loss and grad norm."""
    from spindle.testing.tiny_llm import build_tiny_qwen3_moe

    overrides = {"num_hidden_layers": 2, "router_aux_loss_coef": 0.1}
    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("models") / "qwen3_moe", seed=0, transformer=overrides)


CHAT_LINES = [
    [{"role": "user", "content": "what colour is the circle"}, {"role": "assistant", "content": "red"}],
    [
        {"role": "system", "content": "you say one word"},
        {"role": "user", "content": "which way does the square move"},
        {"role": "assistant", "content": "left then right then up"},
        {"role": "user", "content": "what shape"},
        {"role": "assistant", "content": "a square"},
    ],
    [{"role": "user", "content": "is the sky blue"}, {"role": "assistant", "content": "yes the sky is very blue"}],
]


@pytest.fixture(scope="session")
def lm_corpus(tmp_path_factory) -> Path:
    """A folder of text and chat JSONL: documents of uneven lengths and uneven learned-token counts."""
    import json

    from spindle.testing.synthetic import make_text_corpus

    out = make_text_corpus(tmp_path_factory.mktemp("data") / "lm", num_docs=20, seed=0)
    chats = [json.dumps({"messages": m}) for m in CHAT_LINES * 2]
    (out / "chat.jsonl").write_text("".join(line + "\n" for line in chats), encoding="utf-8")
    return out


def lm_overrides(model: Path, data: Path, output_dir: Path, **values) -> list[str]:
    """Dotted overrides for a short CPU causal-LM run on a tiny model."""
    base = {
        "model.path": model,
        "data.path": data,
        "data.seq_len": 48,
        "train.output_dir": output_dir,
        "train.max_steps": 3,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 4,
        "train.lr": 1e-3,
        "checkpoint.resume": "none",
    }
    base.update({k.replace("__", "."): v for k, v in values.items()})
    return [f"{k}={v}" for k, v in base.items()]
