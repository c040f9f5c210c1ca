"""Qwen3-MoE on one process: step-1 parity with stock transformers (token loss + router aux loss, grad
norm), aux loss and expert load in metrics.jsonl, checkpoint conversion (per-expert <-> fused, errors
naming the key), export into stock transformers in the input's layout."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.config import load_config
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides

RTOL = 1e-5
TEXT = "the red circle moves left on a gray background . then the red circle moves right ."


def run(model, data, out, **overrides):
    from spindle.train.trainer import Trainer

    trainer = Trainer(load_config(None, lm_overrides(model, data, out, **overrides)))
    return trainer, trainer.run()


def stock(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def test_step_one_loss_with_aux_and_grad_norm_equal_stock_transformers(tiny_qwen3_moe, tmp_path):
    model, tok = stock(tiny_qwen3_moe)
    ids = torch.tensor([[*tok(TEXT).input_ids, tok.eos_token_id]])
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n")
    # seq_len = the sample: the router statistics cover every position of a row (as stock's do without
    # an attention mask), so a padded row would route its padding too.
    run(
        tiny_qwen3_moe,
        data,
        tmp_path / "run",
        data__packing=False,
        data__seq_len=ids.shape[1],
        train__max_steps=1,
        train__global_batch_size=1,
        train__micro_batch_size=1,
        checkpoint__export=False,
    )
    (m,) = read_metrics(tmp_path / "run")
    out = model(ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert model.config.router_aux_loss_coef * float(out.aux_loss) > 1e-3 * float(out.loss), "aux must matter"
    assert m["loss"] == pytest.approx(out.loss.item(), rel=RTOL)
    assert m["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=RTOL)
    assert m["grad_norm"] == pytest.approx(float(norm), rel=RTOL)
    # expert load: every (token, top-k) routing of both MoE layers counted once
    routed = ids.shape[1] * model.config.num_experts_per_tok * 2
    assert sum(m["moe_tokens_per_expert"]) == routed and len(m["moe_tokens_per_expert"]) == 8
    assert m["moe_load_imbalance"] >= 1.0
