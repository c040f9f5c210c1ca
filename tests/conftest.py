"""Session fixtures every test module shares (built once per pytest run; see CONTRIBUTING.md).

Tiny checkpoints are standard diffusers folders with random weights; treat them as read-only
(copy one with shutil.copytree before changing it). A module that needs another config builds it
in a module fixture with its own seed and overrides (e.g. `build_tiny_wan(..., seed=3, transformer=...)`).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One thread per process in a test session, set before torch is imported so the pytest-xdist workers, the forkserver
# that forks the ranks and commands, and fresh interpreters all read it: `make test` runs 2 workers on CI's 2 cores
# and a multi-rank test 2 ranks, and torch's default of a thread per core put 4+ threads on the 2 cores, whose OpenMP
# spin-waits took half the suite's CPU time (the DiT conformance parity, overfit, demo and compile tests: 140 s ->
# 65 s). Every process of a session then also rounds alike (a killed run is compared exactly with its uninterrupted
# twin). A developer's machine with more cores runs more workers (`make test PYTEST_WORKERS=8`).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from spindle.api import load_job_config
from spindle.testing.causal_lm_conformance import REFERENCE_RUN, STEP_ONE_TEXT
from spindle.testing.conformance import TEXT_TOKENS
from spindle.testing.multiprocess import dotted_overrides, run_spindle

TINY_SIZE = (32, 32)
TINY_FRAMES = 9
TINY_TEXT = TEXT_TOKENS  # model.max_text_length of the tiny runs (divides the SP degrees the tests use)


# Modules (or one test function of a module) whose tests spread over the pytest-xdist workers one by one (the
# registry-parametrised suites and the other long modules: as one unit each would leave a worker idle at the end);
# every other test runs with the rest of its module on one worker, so module-scoped fixtures (a server, a spawned
# run, a precomputed cache) are built once.
SPREAD_MODULES = (
    "tests/conformance/",
    "tests/serve/test_serve_defaults.py::test_serve_with_default_flags_is_healthy[",
    "tests/distributed/test_train_distributed.py",
    "tests/train/test_grpo_train.py",
    "tests/train/test_flow_grpo_train.py",
)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: `-p no:xdist` runs load this conftest too
def pytest_xdist_make_scheduler(config: Any, log: Any) -> Any:
    """`make test` runs `-n 2 --dist loadscope`: work units are test modules, but for `SPREAD_MODULES`, whose
    tests are units of their own (xdist's loadscope would send each module whole). (`--dist loadgroup` with
    `xdist_group` marks cannot do this: under pytest 9.2 xdist 3.8 no longer sees the groups, pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith(SPREAD_MODULES) else nodeid.split("::", 1)[0]

    return ModuleScheduling(config, log)


def pytest_configure(config: Any) -> None:
    """The thread count above, also where a plugin imported torch before this file set it."""
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_runtest_setup(item: Any) -> None:
    """A test that starts several ranks must be marked `slow` (`spindle.testing.multiprocess.check_marked_slow`
    reads this): the rule is checked when the ranks start, not remembered by whoever adds a test. Set before the
    test's fixtures, so a module fixture that spawns is checked against the test that first needs it."""
    os.environ["SPINDLE_TEST_SLOW"] = "1" if item.get_closest_marker("slow") else "0"


@pytest.fixture(scope="session", autouse=True)
def data_check_cache(tmp_path_factory) -> Path:
    """The media-data check cache (`spindle.data.media_check`) of this test session, not the user's
    (set in the environment, so `spindle` subprocesses use it too)."""
    import os

    folder = tmp_path_factory.mktemp("data-check-cache")
    os.environ["SPINDLE_CACHE_DIR"] = str(folder)
    return folder


# A Flux request with true CFG (negative prompt + true_cfg_scale): the CFG modes (batched, two
# forwards, CFG-parallel ranks) have two branches to combine. tests/infer/test_infer_defaults.py and
# tests/infer/test_flux_engine.py run it on their own tiny checkpoints.
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
    builder with seed 0 and the default configs (a causal-LM family: with its conformance spec's
    `tiny_overrides`), built on first use and shared by the session.
    Tests parametrised over the registry use this; `tiny_wan` / `tiny_flux` are two of them."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            from spindle.testing.specs import declared
            from spindle.testing.tiny import build_tiny

            # a causal-LM family's conformance spec may declare config overrides (e.g. fewer MoE layers)
            overrides = getattr(declared(family), "tiny_overrides", None)
            extra = {"transformer": overrides} if overrides else {}
            built[family] = build_tiny(family, tmp_path_factory.mktemp("models") / family, seed=0, **extra)
        return built[family]

    return get


@pytest.fixture(scope="session")
def tiny_wan(tiny_checkpoint) -> Path:
    """Wan2.1 T2V layout: UMT5 text encoder, AutoencoderKLWan (non-trivial latent mean/std), 2 blocks."""
    return tiny_checkpoint("wan")


@pytest.fixture(scope="session")
def bf16_wan(tiny_wan, tmp_path_factory) -> Path:
    """The tiny Wan with its transformer stored as stock diffusers stores a bf16 load: bf16, except the
    `_keep_in_fp32_modules` (norms, time embedder, modulation table) kept in fp32."""
    import shutil

    import torch
    from diffusers import WanTransformer3DModel

    from spindle.export.dtypes import stored_float_dtypes

    root = tmp_path_factory.mktemp("bf16") / "wan"
    shutil.copytree(tiny_wan, root)
    model = WanTransformer3DModel.from_pretrained(root / "transformer", dtype=torch.bfloat16)
    shutil.rmtree(root / "transformer")
    model.save_pretrained(root / "transformer")
    stored = set(stored_float_dtypes(root / "transformer").values())
    assert stored == {torch.bfloat16, torch.float32}, stored
    return root


@pytest.fixture(scope="session")
def tiny_wan_i2v(tiny_checkpoint) -> Path:
    """Wan2.1 I2V layout: tiny_wan's components + CLIP vision encoder and image processor, transformer
    with 2 x 4 + 4 input channels and an image projection."""
    return tiny_checkpoint("wan_i2v")


@pytest.fixture(scope="session")
def tiny_wan_flf2v(tmp_path_factory) -> Path:
    """Wan2.1 FLF2V layout (a `wan_i2v` checkpoint): tiny_wan_i2v's, with a transformer whose image embedder
    folds two images' CLIP tokens per sample (`pos_embed_seq_len`): it takes a last frame."""
    from spindle.models.wan_i2v.tiny import CLIP_VISION
    from spindle.models.wan_i2v.tiny import build_tiny as build_tiny_wan_i2v

    tokens = (CLIP_VISION["image_size"] // CLIP_VISION["patch_size"]) ** 2 + 1  # patches + the class token
    out = tmp_path_factory.mktemp("models") / "wan_flf2v"
    return build_tiny_wan_i2v(out, seed=4, transformer={"pos_embed_seq_len": 2 * tokens})


@pytest.fixture(scope="session")
def tiny_flux(tiny_checkpoint) -> Path:
    """FLUX.1-dev style: embedded guidance, VAE x2 (32x32 px -> 64 image tokens)."""
    return tiny_checkpoint("flux")


@pytest.fixture(scope="session")
def tiny_flux_kontext(tiny_checkpoint) -> Path:
    """FLUX.1 Kontext layout: tiny_flux's components saved as a FluxKontextPipeline."""
    return tiny_checkpoint("flux_kontext")


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


# Media at several aspect ratios and lengths for data.buckets / data.sources: (name, frames, height, width);
# frames 1 is a png image. With Wan's grid (16) around 32x48, buckets are 9x32x48 (two clips, one of them
# 12 frames long), 9x48x32, 5x32x48 (a 6-frame clip), 1x32x48, 1x48x32, 1x64x32 and 1x16x16 (a 16x24
# image, never enlarged).
MIXED_VIDEOS = (("wide_a", 9, 32, 48), ("wide_b", 12, 32, 48), ("tall_a", 9, 48, 32), ("short", 6, 32, 48))
MIXED_IMAGES = (("wide", 1, 32, 48), ("tall", 1, 48, 32), ("small", 1, 16, 24), ("tall2", 1, 64, 32))


@dataclass(frozen=True)
class MixedMedia:
    videos: Path  # a folder of captioned clips (same-name .txt)
    images: Path  # a .jsonl manifest of images with two captions each


@pytest.fixture(scope="session")
def mixed_media(tmp_path_factory) -> MixedMedia:
    import json

    import numpy as np

    from spindle.data.media import write_image, write_video

    root = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)

    def frames(count: int, height: int, width: int) -> np.ndarray:  # smooth colour ramps, moving
        y, x = np.mgrid[0:height, 0:width]
        base = rng.uniform(0, 1, 3)
        out = [
            np.stack([(x + 2 * t) / width * base[0], y / height * base[1], np.full_like(x, base[2], float)], -1)
            for t in range(count)
        ]
        return np.clip(np.stack(out), 0, 1)

    (root / "videos").mkdir()
    for name, count, height, width in MIXED_VIDEOS:
        write_video(root / "videos" / f"{name}.mp4", frames(count, height, width))
        (root / "videos" / f"{name}.txt").write_text(f"a {name} clip")
    lines = []
    for name, _, height, width in MIXED_IMAGES:
        write_image(root / f"{name}.png", frames(1, height, width)[0])
        lines.append(json.dumps({"path": f"{name}.png", "caption": [f"a {name} still", f"the {name} picture"]}))
    (root / "images.jsonl").write_text("\n".join(lines) + "\n")
    return MixedMedia(root / "videos", root / "images.jsonl")


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


def train_video_lora(model: Path, tmp_path: Path, videos: Path | None = None, **more: Any) -> Path:
    """Two LoRA steps of a tiny video family's checkpoint on two 64x64, 9-frame clips (`videos`, default: shapes
    clips; `more`: further overrides, e.g. `data__audio=True`), at a learning rate that moves the adapters visibly
    -> the export's `lora/` folder, checked to hold `pytorch_lora_weights.safetensors` (what the stock pipelines
    load) and, where the family has an original layout (`lora_original`), that file
    (`original_layout_lora.safetensors`)."""
    from spindle.api import train
    from spindle.data.synthetic import make_shapes_video_dataset
    from spindle.registry import family_of

    if videos is None:
        videos = make_shapes_video_dataset(tmp_path / "videos", num_videos=2, num_frames=9, size=(64, 64))
    overrides = dict(
        data__num_frames=9,
        data__resolution=[64, 64],
        model__max_text_length=16,
        train__max_steps=2,
        train__global_batch_size=2,
        train__lr=3e-2,  # two steps must move the adapters visibly
        train__lora="{rank: 4, alpha: 8}",
        **more,
    )
    result = train(load_job_config(None, train_overrides(model, videos, tmp_path / "run", **overrides)))
    lora_dir: Path = result.export_dir / "lora"
    files = ["pytorch_lora_weights.safetensors"]
    files += ["original_layout_lora.safetensors"] if family_of(model).lora_original else []
    assert sorted(p.name for p in lora_dir.glob("*.safetensors")) == sorted(files)
    return lora_dir


def train_overrides(model: Path, data: Path, output_dir: Path, **train) -> list[str]:
    """Dotted overrides for a short CPU training run on the tiny model (`train__max_steps=3` style keys)."""
    base = {
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
    return dotted_overrides(base, **train)


@pytest.fixture
def make_config(tiny_wan, shapes_videos, tmp_path):
    def make(output_dir: Path | None = None, **overrides):
        return load_job_config(
            None, train_overrides(tiny_wan, shapes_videos, output_dir or tmp_path / "run", **overrides)
        )

    return make


@contextlib.contextmanager
def failing_next_forward(model: Any, message: str = "injected fault") -> Any:
    """Within the block, the next forward of `model` raises RuntimeError(message); later ones run."""
    state = {"armed": True}

    def fault(module, args, kwargs):
        if state.pop("armed", False):
            raise RuntimeError(message)

    handle = model.register_forward_pre_hook(fault, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


# 8 steps of a cosine schedule, a checkpoint every 3 (steps 3 and 6), no export: the run resume tests interrupt
# and compare with an uninterrupted one
RESUME_RUN = dict(
    train__max_steps=8,
    checkpoint__every_steps=3,
    train__lr_schedule="cosine",
    train__warmup_steps=2,
    checkpoint__export=False,
)


def train_interrupted(make_config: Callable[..., Any], out: Path, monkeypatch: Any, step: int, **overrides) -> None:
    """`train(make_config(out, **overrides))` interrupted (KeyboardInterrupt, as Ctrl-C) when step `step`
    begins; the trainer is restored after, so the caller can resume the run (`checkpoint__resume="auto"`)."""
    from spindle.api import train
    from spindle.train.trainer import Trainer

    original = Trainer.train_step

    def crash(self):
        if self.step == step:
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        train(make_config(out, **overrides))
    monkeypatch.setattr(Trainer, "train_step", original)


def stepped_linear() -> tuple[Any, Any]:
    """A seeded nn.Linear(4, 3) and its AdamW after one step: a model and optimizer state to checkpoint."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def spindle_train(out: Path, nproc: int, overrides: list[str]):
    """`spindle train` of an empty config file next to `out` with the dotted `overrides`, on `nproc`
    ranks as the job's workers run it (`spindle_on_ranks`: real processes, gloo, forked warm); asserts
    it succeeded; -> the CompletedProcess (rank 0's output)."""
    from spindle.testing.multiprocess import spindle_on_ranks

    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text("{}\n")
    return spindle_on_ranks(nproc, "train", cfg, *overrides, logs=out.parent / f"{out.name}.log")


def spindle_train_killed(out: Path, overrides: list[str], at_step: int) -> None:
    """`spindle train` (one process, an empty config file next to `out`, the dotted `overrides`) SIGKILLed as
    step `at_step` begins; asserts it died by the signal with steps 1..at_step-1 logged."""
    from spindle.train.metrics import read_metrics

    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text("{}\n")
    proc = run_spindle("train", cfg, *overrides, env={"SPINDLE_TEST_KILL_AT": str(at_step)}, timeout=900)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == list(range(1, at_step))


def train_cli(model: Path, data: Path, out: Path, nproc: int, **train) -> None:
    """`spindle train --nproc N` of an image family on the tiny model (3 steps, micro batch 1,
    shuffled, exported) into `out`; `train` as in `train_overrides` (e.g. parallel__sp=2)."""
    base = dict(data__num_frames=1, train__max_steps=3, train__micro_batch_size=1, checkpoint__export=True)
    spindle_train(out, nproc, train_overrides(model, data, out, data__shuffle=True, **{**base, **train}))


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


def first_transformer_inputs(pipe: Any, **call: Any) -> dict[str, Any]:
    """The keyword arguments a stock diffusers pipeline hands its transformer at its first step of
    `pipe(**call)` (captured by a forward pre-hook; the call's output is not used)."""
    seen: dict[str, Any] = {}

    def capture(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        seen.setdefault("inputs", kwargs)

    hook = pipe.transformer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        pipe(**call)
    finally:
        hook.remove()
    return seen["inputs"]


def sp2_generate_argv(model: Path, out: Path, *args: object) -> tuple[object, ...]:
    """`spindle generate` of MODEL with ARGS, Ulysses SP over 2 processes, written to OUT (seed 0, quiet)."""
    return (
        "generate", "--model", model, "--prompt", "a windmill", "--seed", 0, *args, "--sp", 2, "--quiet", "--out", out,
    )  # fmt: skip


def generate_with_sp2(model: Path, out: Path, *extra: object):
    """`spindle generate --nproc 2 --sp 2` (Ulysses SP over two torchrun workers) of a 32x48, 2-step
    request written to `out`; -> CompletedProcess."""
    size = ("--height", 32, "--width", 48, "--steps", 2)
    return run_spindle(*sp2_generate_argv(model, out, *size, *extra), "--nproc", 2, threads=1)


def generate_on_sp2_ranks(model: Path, out: Path, *args: object):
    """`sp2_generate_argv`'s command as the two workers of `--nproc 2` run it (`spindle_on_ranks`: real processes,
    gloo, forked warm instead of started cold by torchrun); -> rank 0's CompletedProcess. What a family's output
    writer does under SP; the launch itself is `generate_with_sp2`'s (tests/infer/
    test_infer_parallel.py::test_cli_nproc_sp_writes_mp4)."""
    from spindle.testing.multiprocess import spindle_on_ranks

    return spindle_on_ranks(2, *sp2_generate_argv(model, out, *args), logs=out.parent / f"{out.stem}.log")


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
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), library_output_restored():
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse usage errors exit(2) like the real command
                code = e.code if isinstance(e.code, int) else 1
        return CliResult(code, out.getvalue(), err.getvalue())

    return run


@contextlib.contextmanager
def library_output_restored():
    """The process-wide output settings a command changes (spindle.quiet: environment, warning filters,
    diffusers' and transformers' verbosity and progress bars) put back afterwards, so an in-process
    command leaves the rest of the session as it found it."""
    import os
    import warnings

    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    env, filters = dict(os.environ), list(warnings.filters)
    levels = dlog.get_verbosity(), tlog.get_verbosity()
    bars = dlog.is_progress_bar_enabled(), tlog.is_progress_bar_enabled()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)
        warnings.filters[:] = filters
        dlog.set_verbosity(levels[0])
        tlog.set_verbosity(levels[1])
        for lib, on in zip((dlog, tlog), bars, strict=True):
            lib.enable_progress_bar() if on else lib.disable_progress_bar()


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
def tiny_qwen2_5_vl(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("qwen2_5_vl")`: a transformers Qwen2.5-VL folder (config, safetensors, byte-level BPE
    tokenizer with Qwen's specials and chat template, preprocessor_config.json)."""
    return tiny_checkpoint("qwen2_5_vl")


@pytest.fixture(scope="session")
def vlm_conversations(tmp_path_factory) -> Path:
    """8 image conversations (56x84 shapes images, 2 image tokens each) as OpenAI/Qwen messages JSONL;
    every 4th is text-only."""
    from spindle.data.synthetic import make_image_conversations

    return make_image_conversations(tmp_path_factory.mktemp("vlm_data"), 8, size=(56, 84), text_only_every=4)


def vlm_overrides(model: Path, data: Path, out: Path, **values) -> list[str]:
    """Dotted overrides for a short CPU VLM run (`lm_overrides`): rows of `vlm_conformance.SEQ` tokens in the
    file's order, one conversation per micro-batch."""
    from spindle.testing.vlm_conformance import SEQ

    base = dict(data__seq_len=SEQ, data__shuffle=False, train__global_batch_size=1, train__micro_batch_size=1)
    return lm_overrides(model, data, out, **{**base, **values})


def vlm_train(model: Path, data: Path, out: Path, **overrides) -> tuple[Any, Any]:
    """A VLM training run in this process (`vlm_overrides`); -> (trainer, result)."""
    from spindle.api import make_trainer

    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


def seeded_cli_tiny(spindle_cli: Callable[..., Any], family: str, out: Path) -> Path:
    """`spindle tiny-model FAMILY --seed 3` twice (`out`/a, `out`/b) writes the same tensors; -> `out`/a."""
    import torch
    from safetensors.torch import load_file

    for name in ("a", "b"):
        r = spindle_cli("tiny-model", family, out / name, "--seed", "3")
        assert r.returncode == 0, r.stderr
    a, b = (load_file(out / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{family}: tiny-model is not seeded"
    return out / "a"


def single_process_runs(
    make_overrides: Callable[[Path, Path], list[str]], tiny_checkpoint: Callable[[str], Path], tmp_path_factory
) -> Callable[[str], Path]:
    """`get(family)`: the output dir of one `spindle train` process with `make_overrides(model, out)` on the
    family's tiny checkpoint, made on first use: what a suite's 2-process layouts must equal."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            out = tmp_path_factory.mktemp(f"single_{name}") / "run"
            spindle_train(out, 1, make_overrides(tiny_checkpoint(name), out))
            runs[name] = out
        return runs[name]

    return get


def omni_overrides(model: Path, data: Path, out: Path, **values) -> list[str]:
    """Dotted overrides for a short CPU omni run: `vlm_overrides` with rows of `omni_conformance.SEQ` tokens."""
    from spindle.testing.omni_conformance import SEQ

    return vlm_overrides(model, data, out, **{"data__seq_len": SEQ, **values})


def omni_train(model: Path, data: Path, out: Path, **overrides) -> tuple[Any, Any]:
    """An omni training run in this process (`omni_overrides`); -> (trainer, result)."""
    from spindle.api import make_trainer

    trainer = make_trainer(load_job_config(None, omni_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


@pytest.fixture(scope="session")
def tiny_qwen2_5_omni(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("qwen2_5_omni")`: a whole Qwen2.5-Omni folder (thinker, talker, token2wav, spk_dict.pt,
    Omni tokenizer and chat template, one preprocessor_config.json for images and audio)."""
    return tiny_checkpoint("qwen2_5_omni")


@pytest.fixture(scope="session")
def tiny_qwen3_omni_moe(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("qwen3_omni_moe")`: a whole Qwen3-Omni-MoE folder (thinker with 8 experts, talker,
    code2wav, Qwen3-Omni tokenizer and chat template, one preprocessor_config.json for images and audio)."""
    return tiny_checkpoint("qwen3_omni_moe")


@pytest.fixture(scope="session")
def omni_conversations(tmp_path_factory) -> Path:
    """4 conversations (`make_audio_conversations`): a 0.5 s tone (wav); an image, no audio; an image then a
    1 s tone (flac); an image, no audio."""
    from spindle.data.synthetic import make_audio_conversations

    return make_audio_conversations(tmp_path_factory.mktemp("omni_data"), 4)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_checkpoint) -> Path:
    """`tiny_checkpoint("qwen3_moe")`: 8 experts, top-2, per-expert layout, 2 layers, and an aux coefficient
    large enough that a wrong aux loss shows in the step loss and grad norm (its conformance overrides)."""
    return tiny_checkpoint("qwen3_moe")


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
    return dotted_overrides(base, **values)


def lm_train(model: Path, data: Path, out: Path, **overrides) -> tuple[Any, Any]:
    """A causal-LM training run in this process (`lm_overrides`); -> (trainer, result)."""
    from spindle.api import make_trainer

    trainer = make_trainer(load_job_config(None, lm_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


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


def lm_train_cli(model: Path, data: Path, out: Path, nproc: int, **overrides) -> None:
    """`spindle train` of a causal LM (`lm_overrides`) into `out` on `nproc` real processes (`spindle_train`)."""
    spindle_train(out, nproc, lm_overrides(model, data, out, **overrides))


def assert_same_lora_run(one: Path, other: Path) -> None:
    """Two MoE LoRA runs (output dirs: one process, a parallel layout): the same losses, aux losses and grad
    norms (1e-5 relative) and exported PEFT adapters (1e-5), the experts' adapters trained."""
    import torch
    from safetensors.torch import load_file

    from spindle.train.metrics import read_metrics

    ma, mb = read_metrics(one), read_metrics(other)
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    adapters = "export/lora/adapter_model.safetensors"
    wa, wb = load_file(one / adapters), load_file(other / adapters)
    experts_b = [k for k in wa if ".experts.base_layer.lora_B." in k]
    assert wa.keys() == wb.keys() and experts_b and all(wa[k].abs().max() > 0 for k in experts_b)  # trained
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


@pytest.fixture(scope="session")
def lm_reference_run(tiny_checkpoint, lm_corpus, tmp_path_factory) -> Callable[[str], Path]:
    """`lm_reference_run(family)`: the output dir of one process training the family's tiny checkpoint
    (`REFERENCE_RUN`: 4 steps, exported), run once per session: what every parallel layout must equal
    (the conformance suite's and the per-family distributed tests')."""
    runs: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in runs:
            out = tmp_path_factory.mktemp(f"{family}_reference") / "run"
            lm_train_cli(tiny_checkpoint(family), lm_corpus, out, 1, **REFERENCE_RUN)
            runs[family] = out
        return runs[family]

    return get


@pytest.fixture(scope="session")
def lm_step_one(tiny_checkpoint, tmp_path_factory) -> Callable[[str], dict[str, Any]]:
    """`lm_step_one(family)`: the metrics of Spindle's first step over `STEP_ONE_TEXT` as one row of
    seq_len 32 (longer than the text: its padding must not count), run once per session."""
    metrics: dict[str, dict[str, Any]] = {}

    def get(family: str) -> dict[str, Any]:
        if family not in metrics:
            out = tmp_path_factory.mktemp(f"{family}_step_one")
            metrics[family] = one_step_metrics(tiny_checkpoint(family), [STEP_ONE_TEXT], out, seq_len=32)
        return metrics[family]

    return get
