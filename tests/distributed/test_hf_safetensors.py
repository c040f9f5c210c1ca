"""Hugging Face sharded safetensors from Spindle's writers: `save_hf_safetensors` (DCP's HF writer) plus
`append_safetensors` (tensors produced one group at a time, e.g. a MoE's experts converted to the
checkpoint's layout), as stock `from_pretrained` reads them: every file `<stem>-0000i-of-0000N`, the
index mapping each tensor to the file that holds it, its total size the bytes written."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from spindle.export.safetensors import append_safetensors, save_hf_safetensors


def _read(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(folder / file)
        assert all(index["weight_map"][k] == file for k in part)
        tensors.update(part)
    return index, tensors


def test_appended_groups_fill_the_last_file_then_new_ones_all_renumbered(tmp_path):
    torch.manual_seed(0)
    dense = {f"dense.{i}": torch.randn(64, 64) for i in range(3)}  # 16 KiB each
    groups = [{f"experts.{j}.{p}": torch.randn(32, 64) for p in ("a", "b")} for j in range(4)]  # 16 KiB
    save_hf_safetensors(dense, tmp_path, max_shard_bytes=40_000)  # two dense per file: 2 files
    append_safetensors(tmp_path, iter(groups), max_shard_bytes=40_000)

    index, written = _read(tmp_path)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    want = {**dense, **{k: v for g in groups for k, v in g.items()}}
    assert written.keys() == want.keys() and all(torch.equal(written[k], want[k]) for k in want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    # the last dense file took the first group with it, then two groups a file: none over the limit
    assert [sorted(load_file(tmp_path / f)) for f in files] == [
        ["dense.0", "dense.1"],
        ["dense.2", "experts.0.a", "experts.0.b"],
        ["experts.1.a", "experts.1.b", "experts.2.a", "experts.2.b"],
        ["experts.3.a", "experts.3.b"],
    ]


def test_a_small_model_stays_one_file(tmp_path):
    dense = {"w": torch.ones(4, 4)}
    save_hf_safetensors(dense, tmp_path)
    append_safetensors(tmp_path, iter([{"experts.gate_up_proj": torch.zeros(2, 8, 4)}]))
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    _, written = _read(tmp_path)
    assert set(written) == {"w", "experts.gate_up_proj"}
