"""`train.compile` (regional torch.compile of each block) reproduces the eager run; the step reads no
tensor on the host except the logged scalars; AdamW is fused where the device has a fused kernel."""

from __future__ import annotations

import pytest
import torch

from spindle.api import make_trainer, train
from spindle.train.metrics import read_metrics


def test_step_reads_only_the_logged_scalars(make_config):
    """On a GPU every host read of a device tensor is a sync. Measured per step (one process, Wan,
    2 samples): the logged scalars (loss, grad norm; read after the update is queued), the sample
    indexes (the loader's host tensor: no sync) and transformers' T5 mask check (`mask.all()` in the
    frozen text encoder; precomputed conditions avoid it). Any new read fails here."""
    from spindle.train.syncs import HostReads

    trainer = make_trainer(make_config(train__max_steps=2, train__global_batch_size=2, checkpoint__export=False))
    trainer.train_step()  # first step: lazy state (optimizer moments) out of the way
    with HostReads() as reads:
        *_, extra = trainer.train_step()
    ours = [(what, where.rsplit("/", 1)[-1].split(":")[0]) for what, where in reads.calls if "/spindle/" in where]
    assert sorted(ours) == sorted(
        [("__float__", "trainer.py")] * (2 + len(extra)) + [("__int__", "flow_matching.py")] * 2
    ), reads.calls
    theirs = [where for _, where in reads.calls if "/spindle/" not in where]
    assert len(theirs) == 1 and "transformers/masking_utils.py" in theirs[0], reads.calls


def test_clipping_on_the_device_equals_the_host_clip():
    from spindle.distributed.fsdp import clip_grad_norm_tensor_

    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(5, 3)) for _ in range(2))
    for p in (a, b):
        p.grad = torch.randn_like(p) * 10
    ref = [p.grad.clone() for p in (a, b)]
    norm = clip_grad_norm_tensor_([a, b], 1.0)
    assert torch.is_tensor(norm) and float(norm) == pytest.approx(float(torch.cat([g.flatten() for g in ref]).norm()))
    coef = 1.0 / (float(norm) + 1e-6)
    for p, g in zip((a, b), ref, strict=True):
        torch.testing.assert_close(p.grad, g * coef, rtol=1e-6, atol=0)
    assert float(norm) > 1.0  # the case clips


def test_adamw_is_fused_on_cpu(make_config):
    trainer = make_trainer(make_config(train__max_steps=1, checkpoint__export=False))
    assert trainer.optimizer.defaults["fused"] is True


@pytest.mark.slow
def test_compiled_blocks_train_like_eager(make_config, tmp_path):
    """fp32 CPU: losses and grad norms of `train.compile` equal the eager run (1e-5 relative), with
    activation checkpointing on (the checkpoint wraps the compiled block)."""
    common = dict(train__max_steps=3, train__gradient_checkpointing=True, checkpoint__export=False)
    train(make_config(tmp_path / "eager", **common))
    cfg = make_config(tmp_path / "compiled", train__compile=True, **common)
    trainer = make_trainer(cfg)
    from spindle.distributed.blocks import find_blocks

    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in find_blocks(trainer.model))
    trainer.run()
    for key in ("loss", "grad_norm"):
        eager = [m[key] for m in read_metrics(tmp_path / "eager")]
        compiled = [m[key] for m in read_metrics(tmp_path / "compiled")]
        assert compiled == pytest.approx(eager, rel=1e-5), key
