"""LoRA on the fused MoE experts of the multimodal MoE families (Qwen3-VL-MoE, the Qwen3-Omni-MoE thinker)
under expert parallelism, on real torchrun workers (gloo, CPU): ep=2 equals one process. (Qwen3-MoE's:
tests/distributed/test_moe_distributed.py; full fine-tuning of these families at ep2:
tests/conformance/test_vlm_conformance.py, test_omni_conformance.py.)

Both runs LoRA-train q_proj and the experts (`spindle.train.expert_lora`: adapters stacked by expert, split
with the experts over ep) at lr 1e-2 on the whole shared conversations file, one conversation per row and
micro-batch, global batch 2, rows interleaved over the data-parallel ranks. At ep=2 (the dense model
FSDP2-sharded over the same 2 ranks) one rank takes the text-only (VLM) or audio-free (omni) rows, where
its vision or audio tower runs the zero-weight dummy forward, while the other has images or audio, so the
visual (and deepstack) embeddings, the dummy forwards and the router's aux loss all meet the expert
dispatch. Checked as for Qwen3-MoE (`assert_same_lora_run`): losses, aux losses, grad norms 1e-5
relative, exported PEFT adapters 1e-5 absolute.

`train.adam_eps` is 1e-4, not the default 1e-8, so that the comparison measures Spindle and not float32
summation order. The two layouts add each expert's token contributions in a different order, so a gradient
differs by its rounding noise (measured at step 1: at most 1.2e-9 absolute over all adapters, whose
largest gradients are ~4e-2). AdamW's first update is lr * g / (|g| + eps): its slope in g is at most
lr / eps. With eps 1e-8 that is 1e6: an adapter element whose gradient is about 0 and rounds to -2.26e-9
on one process but to -2.14e-9 at ep=2 moves by 1.840e-3 vs 1.766e-3, and the VLM run's export differs by
1.5e-4 (6 elements above 1e-5) although its losses and grad norms agree at 4e-7. With eps 1e-4 the slope
is at most 100 and that noise moves a weight by ~1e-7 (measured: 1.5e-7 VLM, 8e-8 omni). A real
difference still shows: in the losses, aux losses and grad norms (1e-5 relative), and in the adapters,
which Adam at eps 1e-4 still moves by ~lr where |g| >> 1e-4 (the experts' adapter gradients reach 5e-3),
so a missing or misplaced gradient changes them by up to ~lr.
"""

from __future__ import annotations

from typing import Any

import pytest

from spindle.testing.vlm_conformance import REFERENCE_RUN
from tests.conftest import assert_same_lora_run, omni_overrides, spindle_train, vlm_overrides

pytestmark = pytest.mark.slow

EXPERT_LORA: dict[str, Any] = {
    **REFERENCE_RUN,
    "train__lora": '{"rank": 4, "alpha": 8, "targets": ["q_proj", "experts"]}',
    "train__lr": 1e-2,
    "train__adam_eps": 1e-4,  # the module docstring: why not the default 1e-8
}


def test_qwen3_vl_moe_expert_lora_ep2_equals_one_process(tiny_checkpoint, vlm_conversations, tmp_path):
    """The 8 conversations in 4 steps: at ep=2 rank 1 takes the two text-only rows (steps 2 and 4)."""
    model = tiny_checkpoint("qwen3_vl_moe")
    runs = {"one": (1, {}), "ep2": (2, {"parallel__ep": 2})}
    for name, (nproc, layout) in runs.items():
        out = tmp_path / name
        overrides = vlm_overrides(model, vlm_conversations, out, **{**EXPERT_LORA, "train__max_steps": 4, **layout})
        spindle_train(out, nproc, overrides)
    assert_same_lora_run(tmp_path / "one", tmp_path / "ep2")


def test_qwen3_omni_moe_expert_lora_ep2_equals_one_process(tiny_qwen3_omni_moe, omni_conversations, tmp_path):
    """The 4 conversations in 2 steps: at ep=2 rank 0 takes the audio rows, rank 1 the audio-free ones."""
    runs = {"one": (1, {}), "ep2": (2, {"parallel__ep": 2})}
    for name, (nproc, layout) in runs.items():
        out = tmp_path / name
        overrides = omni_overrides(tiny_qwen3_omni_moe, omni_conversations, out, **EXPERT_LORA, **layout)
        spindle_train(out, nproc, overrides)
    assert_same_lora_run(tmp_path / "one", tmp_path / "ep2")
