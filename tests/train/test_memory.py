"""Training memory: frozen weights carry no gradient or optimizer state and are stored in the compute
precision (`train.frozen_dtype`), FSDP2 CPU offload (`train.cpu_offload`) trains the same run, and the
start of a run reports peak memory per rank after load and after the first step."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from spindle.api import load_job_config, make_trainer
from spindle.config import ConfigError
from spindle.distributed.sharded_load import checkpoint_key
from spindle.export.dtypes import stored_float_dtypes
from spindle.train.lora import is_lora_name
from spindle.train.metrics import read_metrics
from tests.conftest import train_overrides

LORA = "{rank: 4, alpha: 8}"
SHORT = dict(train__max_steps=2, train__global_batch_size=2, checkpoint__export=False)


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def test_frozen_base_has_no_grad_nor_optimizer_state_and_is_stored_in_bf16(make_config, tmp_path, caplog):
    runs = {}
    for frozen in ("float32", "auto"):
        cfg = make_config(
            tmp_path / frozen, train__lora=LORA, train__mixed_precision="bf16", train__frozen_dtype=frozen, **SHORT
        )
        with caplog.at_level(logging.INFO, logger="spindle.train"):
            trainer = make_trainer(cfg)
            trainer.run()
        runs[frozen] = trainer
    model = runs["auto"].model
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(n) for n in trainable)
    # no gradient and no optimizer state for the frozen base
    assert all(p.grad is None for p in frozen.values())
    state = runs["auto"].optimizer.state
    assert {id(p) for p in state} == {id(p) for p in trainable.values()}
    # stored in bf16 (auto = the compute precision), except the modules diffusers keeps in fp32
    keep = set(model._keep_in_fp32_modules)
    kept = {n for n in frozen if keep & set(n.split("."))}
    assert kept and all(frozen[n].dtype == torch.float32 for n in kept)
    assert all(p.dtype == torch.bfloat16 for n, p in frozen.items() if n not in kept)
    assert all(p.dtype == torch.float32 for p in trainable.values())  # fp32 master weights
    fp32_frozen = [p for p in runs["float32"].model.parameters() if not p.requires_grad]
    assert _bytes(frozen.values()) < 0.6 * _bytes(fp32_frozen)
    # bf16 compute casts the fp32 base to bf16 anyway: the same losses
    a, b = read_metrics(tmp_path / "float32"), read_metrics(tmp_path / "auto")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-3)

    # peak memory per rank after load and after the first step, logged by rank 0
    peaks = runs["auto"].peak_memory
    assert list(peaks) == ["after load", "after step 1"]
    load, step = peaks["after load"][0], peaks["after step 1"][0]
    assert load.rank == 0 and 0 < load.host_peak_gb <= step.host_peak_gb and load.device_peak_gb is None
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("peak memory")]
    assert logged[-2:] == [  # the second run's lines
        f"peak memory after load: rank 0: host {load.host_peak_gb:.2f} GB",
        f"peak memory after step 1: rank 0: host {step.host_peak_gb:.2f} GB",
    ]


def test_frozen_bf16_needs_bf16_compute(make_config):
    cfg = make_config(train__lora=LORA, train__mixed_precision="'no'", train__frozen_dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"train\.frozen_dtype: bfloat16 .* train\.mixed_precision: bf16"):
        make_trainer(cfg)


def test_cpu_offload_trains_the_same_run_on_one_process(make_config, tmp_path):
    """FSDP2's CPUOffloadPolicy on one process (applied even there: FSDP2 does the offloading); on a
    CPU-only machine host and device are the same memory, so the run is the plain one."""
    plain = make_trainer(make_config(tmp_path / "plain", **SHORT))
    plain.run()
    offloaded = make_trainer(make_config(tmp_path / "offload", train__cpu_offload=True, **SHORT))
    offloaded.run()
    model = offloaded.model
    assert isinstance(model, FSDPModule)
    assert isinstance(model._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    assert all(p.device.type == "cpu" for p in model.parameters())
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "offload")
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5), key
    want = plain.model.state_dict()
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-5, msg=key)


def test_fp32_run_keeps_a_bf16_checkpoints_frozen_base_in_bf16_under_fsdp(bf16_wan, shapes_videos, tmp_path):
    """`frozen_dtype: auto` with fp32 compute under FSDP2 (cpu_offload applies it on one process, as
    several processes do): the frozen base stays in the dtype the checkpoint stores each weight in, and
    FSDP2 upcasts it at the all-gather, so losses, grad norms and trained adapters are the fp32 run's
    exactly, with half the frozen bytes."""
    runs = {}
    for frozen in ("float32", "auto"):
        overrides = train_overrides(
            bf16_wan, shapes_videos, tmp_path / frozen, train__lora=LORA, train__cpu_offload=True,
            train__frozen_dtype=frozen, **SHORT,
        )  # fmt: skip
        trainer = make_trainer(load_job_config(None, overrides))
        trainer.run()
        runs[frozen] = trainer
    stored = stored_float_dtypes(bf16_wan / "transformer")
    frozen = {n: p for n, p in runs["auto"].model.named_parameters() if not p.requires_grad}
    assert {n: p.dtype for n, p in frozen.items()} == {n: stored[checkpoint_key(n)] for n in frozen}
    fp32_frozen = [p for p in runs["float32"].model.parameters() if not p.requires_grad]
    assert all(p.dtype == torch.float32 for p in fp32_frozen)
    assert _bytes(frozen.values()) < 0.6 * _bytes(fp32_frozen)
    a, b = read_metrics(tmp_path / "float32"), read_metrics(tmp_path / "auto")
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in b] == [m[key] for m in a], key
    pairs = zip(runs["float32"].model.named_parameters(), runs["auto"].model.named_parameters(), strict=True)
    for (name, x), (_, y) in pairs:
        if x.requires_grad:
            torch.testing.assert_close(y.full_tensor(), x.full_tensor(), rtol=0, atol=0, msg=name)
