"""LoRA training under torchrun (gloo on CPU): sp=2 and dp_shard=2 equal one process.

Same bounds as tests/distributed/test_train_distributed.py: per-step loss and grad norm within 1e-5 relative,
exported adapters within 1e-4 absolute (only the adapters train; FSDP2 shards frozen base weights too).
The runs also render a validation sample at the last step through the sharded / SP model: rank 0
writes it, and it matches the one-process sample up to mp4 coding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.test_train_distributed import RTOL, WEIGHT_ATOL, run_train, series

pytestmark = pytest.mark.slow
VALIDATION = (
    '{every_steps: 3, prompts: ["a red circle moves left"], num_inference_steps: 2, num_frames: 5, guidance_scale: 1.0}'
)
LORA = dict(train__lora="{rank: 4, alpha: 8}", train__max_steps=3, train__validation=VALIDATION)


def adapters(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "export" / "lora" / "pytorch_lora_weights.safetensors")


@pytest.fixture(scope="module")
def single(tiny_wan, shapes_videos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_single") / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=1, **LORA)
    return out


@pytest.mark.parametrize(
    "layout", [{"parallel__dp_shard": 2}, {"parallel__sp": 2, "parallel__dp_shard": 1}], ids=["dp_shard2", "sp2"]
)
def test_lora_two_processes_equal_one(layout, single, tiny_wan, shapes_videos, tmp_path):
    out = tmp_path / "run"
    run_train(tiny_wan, shapes_videos, out, nproc=2, **LORA, **layout)
    for key in ("loss", "grad_norm"):
        assert series(out, key) == pytest.approx(series(single, key), rel=RTOL), key
    a, b = adapters(single), adapters(out)
    assert a.keys() == b.keys() and len(a) > 0
    worst = max(abs(b[k] - a[k]).max().item() for k in a)
    assert worst <= WEIGHT_ATOL, f"adapter weights differ by {worst:.3g}"
    assert any(a[k].abs().max() > 0 for k in a if ".lora_B." in k)
    one, two = sample_frames(single), sample_frames(out)
    assert (one - two).abs().max().item() <= 0.1, "the sharded model's validation sample differs"


def sample_frames(out: Path) -> torch.Tensor:
    from spindle.data.media import read_video

    files = sorted((out / "samples").rglob("*.mp4"))
    assert [f.relative_to(out).as_posix() for f in files] == ["samples/step-000003/00.mp4"]
    return read_video(files[0], 5, (32, 32))
