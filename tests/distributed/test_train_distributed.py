"""Multi-process training (real torchrun workers, gloo on CPU) equals single-process training.

Every run trains the same 4 steps on the same data with global batch 4; only the layout differs.
Tolerance: fp32 on CPU, 1e-5 relative on per-step loss and grad norm (reduction order differs between
layouts, so bit-equality is not expected). Exported weights: 1e-4 absolute after 4 AdamW steps at lr 1e-3.
Adam divides each element's step by that element's gradient RMS, so a gradient element that is a
near-cancelling sum (rounding-level differences are then a large fraction of it) can move by a visible
fraction of lr; typical differences are ~3e-6, the bound is a tenth of one step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from spindle.train.metrics import read_metrics
from tests.conftest import run_spindle, spindle_train, train_overrides

pytestmark = pytest.mark.slow
RTOL = 1e-5
WEIGHT_ATOL = 1e-4


def run_train(model: Path, data: Path, out: Path, nproc: int, **overrides):
    """`spindle train --nproc N` of the tiny video model: 4 steps, micro batch 1, shuffled, exported;
    -> the CompletedProcess (its output)."""
    base = dict(train__max_steps=4, train__micro_batch_size=1, checkpoint__export=True, data__shuffle=True)
    return spindle_train(out, nproc, train_overrides(model, data, out, **{**base, **overrides}))


def series(out: Path, key: str) -> list[float]:
    return [m[key] for m in read_metrics(out)]


def exported(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "export" / "transformer" / "diffusion_pytorch_model.safetensors")


@pytest.fixture(scope="module")
def single(tiny_wan, shapes_videos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=1)
    return out


def assert_same_run(a: Path, b: Path) -> None:
    for key in ("loss", "grad_norm"):
        assert series(b, key) == pytest.approx(series(a, key), rel=RTOL), key
    wa, wb = exported(a), exported(b)
    assert wa.keys() == wb.keys()
    worst = max(wa, key=lambda k: (wb[k] - wa[k]).abs().max().item())
    diff = (wb[worst] - wa[worst]).abs()
    assert diff.max().item() <= WEIGHT_ATOL, (
        f"{worst}: max |diff| {diff.max().item():.3g} at {diff.argmax().item()}, "
        f"{(diff > WEIGHT_ATOL).sum().item()} of {diff.numel()} elements over {WEIGHT_ATOL}"
    )


@pytest.mark.parametrize(
    "layout",
    [
        {"parallel__dp_shard": 2},
        {"parallel__sp": 2, "parallel__dp_shard": 1},
        {"parallel__dp_replicate": 2, "parallel__dp_shard": 1},
    ],
    ids=["dp_shard2", "sp2", "dp_replicate2"],
)
def test_two_processes_equal_one(layout, single, tiny_wan, shapes_videos, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=2, **layout)
    assert_same_run(single, out)


def test_fsdp_over_dp_shard_and_sp_equals_one(single, tiny_wan, shapes_videos, tmp_path):
    """dp_shard=2 x sp=2 on 4 processes: FSDP shards over all 4 ranks, data splits over 2, SP pairs sum."""
    out = tmp_path / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=4, parallel__dp_shard=2, parallel__sp=2)
    assert_same_run(single, out)


def test_ring_runs_a_three_head_model_on_two_processes(shapes_videos, tmp_path):
    """Ulysses cannot split 3 heads over 2 ranks; ring attention splits only the sequence."""
    from spindle.models.wan.tiny import build_tiny as build_tiny_wan

    model = build_tiny_wan(tmp_path / "wan3", seed=0, transformer={"num_attention_heads": 3})
    single, ring = tmp_path / "single", tmp_path / "ring"
    run_train(model, shapes_videos, single, nproc=1)
    run_train(model, shapes_videos, ring, nproc=2, parallel__ring=2, parallel__dp_shard=1)
    assert_same_run(single, ring)


@pytest.mark.parametrize("first,second", [(2, 1), (1, 2)], ids=["save2_resume1", "save1_resume2"])
def test_resume_across_world_sizes(first, second, single, tiny_wan, shapes_videos, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=first, train__max_steps=2, checkpoint__export=False)
    run_train(tiny_wan, shapes_videos, out, nproc=second, checkpoint__resume="auto")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert_same_run(single, out)


def test_sequence_not_divisible_by_sp_names_token_count(tiny_wan, shapes_videos, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    # 16x16 px, 9 frames -> 3 latent frames x 1 x 1 patches = 3 tokens, not divisible by sp=2
    args = train_overrides(
        tiny_wan,
        shapes_videos,
        tmp_path / "o",
        parallel__sp=2,
        parallel__dp_shard=1,
        data__resolution=[16, 16],
        train__micro_batch_size=1,
    )
    proc = run_spindle("train", cfg, *args, "--nproc", 2, timeout=300)
    assert proc.returncode != 0
    # said before launch, from the config and the checkpoint's configs: no worker started, nothing written
    assert "makes 3 tokens, which is not divisible by parallel.sp x parallel.ring = 2" in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


def test_image_to_video_sequence_parallel_equals_one(tiny_wan_i2v, shapes_videos, tmp_path):
    """Wan2.1 I2V (conditioning channels, CLIP image tokens before 512 text tokens): sp=2 trains as one process."""
    from spindle.models.wan_i2v import TEXT_LENGTH

    one, two = tmp_path / "one", tmp_path / "two"
    run_train(tiny_wan_i2v, shapes_videos, one, nproc=1, model__max_text_length=TEXT_LENGTH)
    run_train(
        tiny_wan_i2v,
        shapes_videos,
        two,
        nproc=2,
        parallel__sp=2,
        parallel__dp_shard=1,
        model__max_text_length=TEXT_LENGTH,
    )
    assert_same_run(one, two)
