"""Session fixtures every test module shares (built once per pytest run; see CONTRIBUTING.md).

Tiny checkpoints are standard diffusers folders with random weights; treat them as read-only
(copy one with shutil.copytree before changing it). A module that needs another config builds it
in a module fixture with its own seed and overrides (e.g. `build_tiny_wan(..., seed=3, transformer=...)`).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from spindle.api import load_job_config

TINY_SIZE = (32, 32)
TINY_FRAMES = 9
TINY_TEXT = 16  # model.max_text_length of the tiny runs (divides the SP degrees the tests use)


# A Flux request with true CFG (negative prompt + true_cfg_scale): the CFG modes (batched, two
# forwards, CFG-parallel ranks) have two branches to combine. tests/test_infer_defaults.py and
# tests/test_flux_engine.py run it on their own tiny checkpoints.
FLUX_TRUE_CFG = dict(
    prompt="a windmill at sunset",
    negative_prompt="blurry",
    height=32,
    width=48,
    num_inference_steps=3,
    guidance_scale=3.5,
    max_sequence_length=16,
    seed=21,
    true_cfg_scale=3.0,
)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """`tiny_checkpoint(family)` -> that family's tiny checkpoint: its registered `tiny_model`
    builder with the default configs and seed 0, built on first use and shared by the session.
    Tests parametrised over the registry use this; `tiny_wan` / `tiny_flux` are two of them."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            from spindle.contracts.family import import_object
            from spindle.registry import get_family

            spec = get_family(family)
            if spec.tiny_model is None:
                raise ValueError(f"family {family!r} registers no tiny_model builder")
            built[family] = import_object(spec.tiny_model)(tmp_path_factory.mktemp("models") / family, seed=0)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_wan(tiny_checkpoint) -> Path:
    """Wan2.1 T2V layout: UMT5 text encoder, AutoencoderKLWan (non-trivial latent mean/std), 2 blocks."""
    return tiny_checkpoint("wan")


@pytest.fixture(scope="session")
def tiny_wan_i2v(tiny_checkpoint) -> Path:
    """Wan2.1 I2V layout: tiny_wan's components + CLIP vision encoder and image processor, transformer
    with 2 x 4 + 4 input channels and an image projection."""
    return tiny_checkpoint("wan_i2v")


@pytest.fixture(scope="session")
def tiny_flux(tiny_checkpoint) -> Path:
    """FLUX.1-dev style: embedded guidance, VAE x2 (32x32 px -> 64 image tokens)."""
    return tiny_checkpoint("flux")


@pytest.fixture(scope="session")
def shapes_images(tmp_path_factory) -> Path:
    """8 captioned 32x32 png images of moving-shape scenes (image families' training data)."""
    from spindle.data.synthetic import make_shapes_image_dataset

    return make_shapes_image_dataset(tmp_path_factory.mktemp("data") / "shapes_images", num_images=8, size=TINY_SIZE)


@pytest.fixture(scope="session")
def shapes_videos(tmp_path_factory) -> Path:
    from spindle.data.synthetic import make_shapes_video_dataset

    return make_shapes_video_dataset(
        tmp_path_factory.mktemp("data") / "shapes", num_videos=8, num_frames=TINY_FRAMES, size=TINY_SIZE
    )


@pytest.fixture(scope="module")
def tiny_condition(tiny_checkpoint) -> Callable[[str], Any]:
    """`tiny_condition(family)`: the family's condition model (the training side: VAE, text encoders)
    on its tiny checkpoint with model.max_text_length TINY_TEXT; built once per module and family."""
    built: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in built:
            from spindle.registry import get_family

            cls = get_family(family).condition_model_cls()
            built[family] = cls.from_pretrained(tiny_checkpoint(family), max_text_length=TINY_TEXT)
        return built[family]

    return get


def encode_two_samples(condition: Any, captions: list[str], num_frames: int = 1) -> tuple[dict, dict]:
    """Two training samples as the data loader batches them (seeded pixels in [-1, 1] of shape
    [2, 3, num_frames, *TINY_SIZE], `captions`, dataset indices 3 and 5) -> (batch, condition.encode(batch))."""
    import torch

    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, num_frames, *TINY_SIZE, generator=g) * 2 - 1
    batch = {"pixels": pixels, "caption": captions, "index": [3, 5]}
    return batch, condition.encode(batch)


def train_overrides(model: Path, data: Path, output_dir: Path, **train) -> list[str]:
    """Dotted overrides for a short CPU training run on the tiny model."""
    values = {
        "model.path": model,
        "model.max_text_length": TINY_TEXT,
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
        return load_job_config(
            None, train_overrides(tiny_wan, shapes_videos, output_dir or tmp_path / "run", **overrides)
        )

    return make


def run_spindle(*args, timeout: float = 600, threads: int | None = None):
    """`python -m spindle ARGS...` in a subprocess (this tree's code via PYTHONPATH); -> CompletedProcess.
    `threads`: OMP_NUM_THREADS for it (1 for `--nproc` runs, whose workers share the cores)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    return subprocess.run(
        [sys.executable, "-m", "spindle", *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env
    )


def train_cli(model: Path, data: Path, out: Path, nproc: int, **train) -> None:
    """`spindle train --nproc N` of an image family on the tiny model (3 steps, micro batch 1,
    shuffled, exported) into `out`; `train` as in `train_overrides` (e.g. parallel__sp=2)."""
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text("{}\n")
    base = dict(data__num_frames=1, train__max_steps=3, train__micro_batch_size=1, checkpoint__export=True)
    proc = run_spindle(
        "train", cfg, *train_overrides(model, data, out, data__shuffle=True, **{**base, **train}), "--nproc", nproc
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_training(a: Path, b: Path) -> None:
    """Two training runs (output dirs) logged the same losses and grad norms (rel 1e-5) and exported
    the same weights (1e-5): a parallel layout against one process."""
    import pytest
    import torch
    from safetensors.torch import load_file

    from spindle.train.metrics import read_metrics

    ma, mb = read_metrics(a), read_metrics(b)
    assert len(ma) == len(mb) > 0
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    weights = "export/transformer/diffusion_pytorch_model.safetensors"
    wa, wb = load_file(a / weights), load_file(b / weights)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


def check_demo(family: str, out: Path) -> None:
    """`spindle demo --family F --steps 30`: tiny model -> dataset -> fine-tune (the loss falls) ->
    export the family's stock pipeline loads -> a sample of the demo size."""
    import json
    import statistics

    import numpy as np
    from PIL import Image

    from spindle.registry import get_family
    from spindle.train.metrics import read_metrics

    spec = get_family(family)
    pipeline = spec.pipeline_classes[0]
    proc = run_spindle("demo", "--family", family, "--out", out, "--steps", 30)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"{pipeline}.from_pretrained loads it" in proc.stdout
    losses = [m["loss"] for m in read_metrics(out / "run")]
    assert statistics.mean(losses[-5:]) < 0.6 * statistics.mean(losses[:5])
    assert np.asarray(Image.open(out / "sample.png")).shape == (*spec.demo.size, 3)
    assert json.loads((out / "run" / "export" / "model_index.json").read_text())["_class_name"] == pipeline


def generate_with_sp2(model: Path, out: Path, *extra: object):
    """`spindle generate --nproc 2 --sp 2` (Ulysses SP over two torchrun workers) of a 32x48, 2-step
    request written to `out`; -> CompletedProcess."""
    size = ("--height", 32, "--width", 48, "--steps", 2, "--seed", 0)
    sp = ("--nproc", 2, "--sp", 2, "--quiet")
    return run_spindle(
        "generate", "--model", model, "--prompt", "a windmill", *size, *extra, *sp, "--out", out, threads=1
    )


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def spindle_cli() -> Callable[..., CliResult]:
    """`spindle_cli(*args)` runs `spindle ARGS` inside this process through `spindle.cli.main`, the
    function the console script and `python -m spindle` call, and returns its exit code and output.

    Saves a fresh interpreter and the torch/diffusers import (~4 s of CPU) per call: use it for
    error paths and quick commands. Keep a real subprocess where the process itself is the point:
    servers, `--nproc` (torchrun), signals, anything that initialises torch.distributed.
    """

    def run(*args: object) -> CliResult:
        from spindle.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse usage errors exit(2) like the real command
                code = e.code if isinstance(e.code, int) else 1
        return CliResult(code, out.getvalue(), err.getvalue())

    return run


# ---------------------------------------------------------------- language models


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("qwen3")`: a transformers Qwen3 folder (config.json, safetensors, tokenizer)."""
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("llama")`: a transformers Llama folder (its tokenizer adds <s> itself)."""
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> Path:
    """Tiny Qwen3-MoE (8 experts, top-2, per-expert layout), 2 layers; an aux coefficient large enough
    that a wrong aux loss shows in the step loss and grad norm."""
    from spindle.models.qwen3_moe.tiny import build_tiny_qwen3_moe

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

    from spindle.data.synthetic import make_text_corpus

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


def lm_train(model: Path, data: Path, out: Path, **overrides) -> tuple[Any, Any]:
    """A causal-LM training run in this process (`lm_overrides`); -> (trainer, result)."""
    from spindle.api import make_trainer

    trainer = make_trainer(load_job_config(None, lm_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


def lm_stock(path: Path) -> tuple[Any, Any]:
    """Stock transformers on a causal-LM folder: (the fp32 model, its tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def one_step_metrics(model: Path, texts: list[str], out: Path, seq_len: int, **overrides) -> dict[str, Any]:
    """One optimizer step of Spindle over the text documents `texts`, unpacked rows in the order given,
    all in one micro-batch (what a stock forward of the same rows computes) -> that step's metrics."""
    import json

    from spindle.train.metrics import read_metrics

    data = out / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    batch = len(texts)
    lm_train(
        model, data, out / "run", data__packing=False, data__shuffle=False, data__seq_len=seq_len,
        train__max_steps=1, train__global_batch_size=batch, train__micro_batch_size=batch,
        checkpoint__export=False, **overrides,
    )  # fmt: skip
    (metrics,) = read_metrics(out / "run")
    return metrics
