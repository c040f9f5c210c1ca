"""Omni training on real torchrun workers (gloo on CPU) equals one process: FSDP2 over audio encoder layers,
vision blocks and decoder layers with one rank's micro-batches audio-free (its audio encoder runs the
zero-weight dummy forward, so the FSDP2 collectives match and nothing hangs), and Ulysses SP over the
decoder (positions computed on whole conversations before the split, audio and vision filled in first).

Each run trains the same 2 steps of the tiny Qwen2.5-Omni on the 4 shared conversations, one per row, in
order (audio, image, image + audio, image): global batch 2 in micro-batches of 1, so with dp_shard=2 rank 0
sees only audio rows and rank 1 only audio-free ones. Loss and grad norm match one process to 1e-5
relative, the exported thinker weights to 1e-5, and the talker's tensors are the input's. The same data
trains the tiny Qwen3-Omni-MoE with `parallel.ep=2` and `sp=2` against one process.
"""

from __future__ import annotations

import pytest
import torch

from spindle.testing.vlm_conformance import REFERENCE_RUN, subset
from spindle.train.metrics import read_metrics
from tests.distributed.test_vlm_distributed import run_train
from tests.train.test_omni import SEQ, untrained_bytes

pytestmark = pytest.mark.slow
STEPS = REFERENCE_RUN["train__max_steps"]  # run_train's steps (the VLM suite's reference run)
WEIGHTS = "export/model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def data(omni_conversations, tmp_path_factory):
    return subset(omni_conversations, tmp_path_factory.mktemp("omni_rows"), [0, 1, 2, 3])


@pytest.fixture(scope="module")
def single(tiny_qwen2_5_omni, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("omni_single") / "run"
    run_train(tiny_qwen2_5_omni, data, out, nproc=1, data__seq_len=SEQ)
    return out


@pytest.mark.parametrize(
    "layout",
    [{"parallel__dp_shard": 2}, {"parallel__sp": 2, "parallel__dp_shard": 1}],
    ids=["dp_shard2_audio_free_rank", "sp2"],
)
def test_layout_equals_one_process(layout, single, tiny_qwen2_5_omni, data, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_train(tiny_qwen2_5_omni, data, out, nproc=2, data__seq_len=SEQ, **layout)
    ma, mb = read_metrics(single), read_metrics(out)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    wa, wb = load_file(single / WEIGHTS), load_file(out / WEIGHTS)
    assert wa.keys() == wb.keys() and all(k.startswith("thinker.") for k in wa)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)
    assert untrained_bytes(out / "export") == untrained_bytes(tiny_qwen2_5_omni)


@pytest.fixture(scope="module")
def qwen3_single(tiny_qwen3_omni_moe, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("omni_moe_single") / "run"
    run_train(tiny_qwen3_omni_moe, data, out, nproc=1, data__seq_len=SEQ)
    return out


@pytest.mark.parametrize(
    "layout", [{"parallel__ep": 2}, {"parallel__sp": 2, "parallel__dp_shard": 1}], ids=["ep2_audio_free_rank", "sp2"]
)
def test_qwen3_omni_moe_layout_equals_one_process(layout, qwen3_single, tiny_qwen3_omni_moe, data, tmp_path):
    """Qwen3-Omni-MoE with the thinker's experts split over 2 ranks (`parallel.ep=2`: 4 of the 8 experts each,
    tokens exchanged by all-to-all; the dense parameters FSDP2-sharded over the same 2 ranks, one of which sees
    only audio-free rows), and with Ulysses SP over the decoder (the router statistics summed over the SP
    group): the same losses (router aux loss included), aux losses, grad norms and expert loads as one process,
    the same exported thinker (its experts per expert, as the input stores them), the talker and code2wav as
    they came."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    run_train(tiny_qwen3_omni_moe, data, out, nproc=2, data__seq_len=SEQ, **layout)
    ma, mb = read_metrics(qwen3_single), read_metrics(out)
    assert [m["step"] for m in mb] == list(range(1, STEPS + 1))
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [m[key] for m in mb] == pytest.approx([m[key] for m in ma], rel=1e-5), key
    assert [m["moe_tokens_per_expert"] for m in mb] == [m["moe_tokens_per_expert"] for m in ma]
    wa, wb = load_file(qwen3_single / WEIGHTS), load_file(out / WEIGHTS)
    assert wa.keys() == wb.keys() and "thinker.model.layers.1.mlp.experts.7.up_proj.weight" in wa
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)
    untrained = ("talker.", "code2wav.")
    assert untrained_bytes(out / "export", untrained) == untrained_bytes(tiny_qwen3_omni_moe, untrained)
