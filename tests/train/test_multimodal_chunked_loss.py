"""The dense VLM and omni families (Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni) train through patchgen-generated
classes whose loss is the chunked linear cross-entropy from the hidden states (spindle/models/*/patches.py,
spindle/models/shared/causal_lm_patch.py): the loss and every gradient equal stock transformers'
full-logit path (1e-6; mean and the summed reduction Spindle asks for), on a conversation with an image
(and audio, omni), and the loss path builds no [tokens, vocab] logits. Without labels the logits are
stock's exactly (what generate() reads)."""

from __future__ import annotations

import pytest
import torch

from spindle.registry import get_family
from spindle.testing import omni_conformance as omni_suite
from spindle.testing import vlm_conformance as vlm_suite

FAMILIES = [("qwen2_5_vl", "vlm"), ("qwen3_vl", "vlm"), ("qwen2_5_omni", "omni")]
TOL = dict(rtol=1e-6, atol=1e-6)


def loss_and_grads(model, inputs, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits, grads


@pytest.mark.parametrize(("name", "kind"), FAMILIES, ids=[n for n, _ in FAMILIES])
def test_chunked_loss_equals_the_full_logit_path(
    name, kind, tiny_checkpoint, vlm_conversations, omni_conversations, tmp_path
):
    family = get_family(name)
    path = tiny_checkpoint(name)
    if kind == "vlm":
        stock = vlm_suite.stock_model(path)
        inputs = vlm_suite.stock_inputs(path, vlm_suite.subset(vlm_conversations, tmp_path / "data", [0]))[0]
    else:
        stock = omni_suite.stock_thinker(family, path)
        data = vlm_suite.subset(omni_conversations, tmp_path / "data", [2])  # an image, then audio
        inputs = omni_suite.stock_inputs(path, data, family)[0]
    patched = family.model_cls().from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    assert type(patched).__module__.startswith(f"spindle.models.{name}.generated.")
    assert type(stock).__module__.startswith("transformers.")
    stock.eval(), patched.eval()
    for extra in ({}, {"num_items_in_batch": 1}):  # the mean, and the sum over valid tokens (Spindle's)
        want, _, want_grads = loss_and_grads(stock, inputs, **extra)
        got, logits, got_grads = loss_and_grads(patched, inputs, **extra)
        assert logits is None, f"{name}: the loss path built [tokens, vocab] logits"
        torch.testing.assert_close(got, want, **TOL)
        assert got_grads.keys() == want_grads.keys()
        for key, grad in want_grads.items():
            torch.testing.assert_close(got_grads[key], grad, **TOL, msg=lambda m, k=key: f"{name} {k}: {m}")
    no_labels = {k: v for k, v in inputs.items() if k != "labels"}
    with torch.no_grad():
        assert torch.equal(patched(**no_labels).logits, stock(**no_labels).logits)
