"""Sharded loading (issue 26.1) on 2 real processes (gloo, dp_shard=2): every family kind's model,
built on meta and filled rank by rank from its shards' bytes, equals the whole-model load tensor for
tensor after gathering (parameters and buffers, non-persistent ones included: rotary tables); and
training from it logs the old path's losses and grad norms (1e-5 relative, fp32 CPU).

One spawn runs every case (importing torch + diffusers + transformers per process is the slow part).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spindle.testing.multiprocess import spawn
from spindle.testing.tiny import with_expert_layout
from tests.conftest import lm_overrides, train_overrides, vlm_overrides

pytestmark = pytest.mark.slow
RTOL = 1e-5
LORA = "{rank: 4, alpha: 8}"
DIT = ("wan", "flux", "qwenimage")
LM = ("qwen3", "llama")


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too), gathered whole (collective)."""
    from torch.distributed.tensor import DTensor

    named = [*model.named_parameters(), *model.named_buffers()]
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone() for n, t in named}


def _worker(rank: int, world: int, cases: dict[str, list[str]], runs: dict[str, list[str]], out: str) -> None:
    from spindle.api import load_job_config, make_trainer
    from spindle.train.metrics import read_metrics

    results: dict[str, object] = {}
    for name, overrides in cases.items():
        loaded = {}
        for sharded in (True, False):
            trainer = make_trainer(load_job_config(None, [*overrides, f"model.sharded_load={sharded}"]))
            loaded[sharded] = full_tensors(trainer.model)
            del trainer
        results[name] = loaded
    for name, overrides in runs.items():
        metrics = {}
        for sharded in (True, False):
            cfg = load_job_config(
                None, [*overrides, f"model.sharded_load={sharded}", f"train.output_dir={out}/{name}{sharded}"]
            )
            make_trainer(cfg).run()
            metrics[sharded] = [(m["loss"], m["grad_norm"]) for m in read_metrics(Path(cfg.train.output_dir))]
        results[f"run:{name}"] = metrics
    if rank == 0:
        torch.save(results, Path(out) / "results.pt")


@pytest.fixture(scope="module")
def results(
    tiny_checkpoint, tiny_qwen3_moe, shapes_videos, shapes_images, lm_corpus, vlm_conversations, tmp_path_factory
) -> dict:
    out = tmp_path_factory.mktemp("sharded_load")
    cases: dict[str, list[str]] = {}
    for family in DIT:
        image = {} if family == "wan" else {"data__num_frames": 1}
        data = shapes_videos if family == "wan" else shapes_images
        cases[family] = train_overrides(tiny_checkpoint(family), data, out / family, **image)
    # train.seed differs from the tiny checkpoints' seed: a model left at its random initialisation
    # (nothing read) must not equal the checkpoint by coincidence
    seed = {"train__seed": 7}
    for family in LM:
        cases[family] = lm_overrides(tiny_checkpoint(family), lm_corpus, out / family, **seed)
    cases["qwen3_moe"] = lm_overrides(tiny_qwen3_moe, lm_corpus, out / "moe", **seed)  # per-expert -> fused
    cases["qwen3_moe_ep2"] = lm_overrides(tiny_qwen3_moe, lm_corpus, out / "moe_ep2", parallel__ep=2, **seed)
    # Qwen3-VL-MoE under EP from Qwen's transposed fused layout and from per-expert tensors: each rank reads
    # its experts' bytes (transposed, or stacked per expert) into its shards
    for layout in ("fused_transposed", "per_expert"):
        path = with_expert_layout("qwen3_vl_moe", tiny_checkpoint("qwen3_vl_moe"), out / f"vl_moe_{layout}", layout)
        cases[f"qwen3_vl_moe_{layout}_ep2"] = vlm_overrides(
            path, vlm_conversations, out / f"vl_moe_{layout}_run", parallel__ep=2, train__global_batch_size=2, **seed
        )
    cases["wan_lora"] = train_overrides(tiny_checkpoint("wan"), shapes_videos, out / "lora", train__lora=LORA)
    runs = {
        "wan_lora": train_overrides(tiny_checkpoint("wan"), shapes_videos, out, train__max_steps=2, train__lora=LORA),
        "qwen3": lm_overrides(tiny_checkpoint("qwen3"), lm_corpus, out, train__max_steps=2, **seed),
        "qwen3_moe_ep2": lm_overrides(tiny_qwen3_moe, lm_corpus, out, train__max_steps=2, parallel__ep=2, **seed),
    }
    spawn(_worker, 2, cases, runs, str(out))
    return torch.load(out / "results.pt")


VL_MOE = ["qwen3_vl_moe_fused_transposed_ep2", "qwen3_vl_moe_per_expert_ep2"]


@pytest.mark.parametrize("case", [*DIT, *LM, "qwen3_moe", "qwen3_moe_ep2", *VL_MOE, "wan_lora"])
def test_sharded_load_equals_full_load_tensor_for_tensor(results, case):
    sharded, full = results[case][True], results[case][False]
    assert sharded.keys() == full.keys()
    for key in full:
        assert sharded[key].dtype == full[key].dtype, key
        torch.testing.assert_close(sharded[key], full[key], rtol=0, atol=0, msg=key)
    if case.startswith("qwen3") or case == "llama":
        assert any(k.endswith("rotary_emb.inv_freq") for k in full)  # a non-persistent buffer, computed
    if case == "wan_lora":
        assert any(".lora_A." in k for k in full) and any(".lora_B." in k for k in full)


@pytest.mark.parametrize("run", ["wan_lora", "qwen3", "qwen3_moe_ep2"])
def test_training_from_a_sharded_load_logs_the_old_paths_losses(results, run):
    sharded, full = results[f"run:{run}"][True], results[f"run:{run}"][False]
    assert len(sharded) == len(full) == 2
    assert [x for step in sharded for x in step] == pytest.approx([x for step in full for x in step], rel=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_blocks_are_read_at_their_byte_offset_equal_to_the_mapped_slice(dtype, tmp_path):
    """An FSDP2 shard (whole rows) is read with a plain file read, not through a memory map that would
    keep the pages resident; it equals safetensors' own slice, and other regions still read as before."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from spindle.distributed.sharded_load import SafetensorsCheckpoint

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, 3, generator=g).to(dtype), "b": torch.randn(11, generator=g).to(dtype)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for key, region in [
            ("a", (slice(2, 6), slice(0, 5), slice(0, 3))),
            ("a", (slice(0, 7), slice(0, 5), slice(0, 3))),
            ("a", (slice(1, 3), slice(1, 4), slice(0, 3))),  # not whole rows: the mapped slice
            ("b", (slice(4, 11),)),
        ]:
            got = ckpt.read(key, region)
            assert got.dtype == dtype and torch.equal(got, f.get_slice(key)[region]), (key, region)


def test_a_truncated_file_is_named_when_a_row_block_runs_past_its_end(tmp_path):
    from safetensors.torch import save_file

    from spindle.distributed.sharded_load import SafetensorsCheckpoint

    save_file({"a": torch.ones(64, 64)}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(OSError, match=r"model.safetensors ended inside tensor 'a'; the file is truncated"):
        ckpt.read("a", (slice(32, 64), slice(0, 64)))
