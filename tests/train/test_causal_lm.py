"""Causal-LM training on one process, what the conformance suite does not cover: document masking, loss
invariance under micro-batching, sharded exports, gradient checkpointing, config errors, the demo."""

from __future__ import annotations

import json

import pytest
import torch

from spindle.api import load_job_config
from spindle.config import ConfigError
from spindle.testing.causal_lm_conformance import stock as lm_stock
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, lm_train, run_spindle

RTOL = 1e-5


# The tiny checkpoints (stock load, `spindle tiny-model`, the registry's model_type lookup), the patched
# classes against stock transformers, step-1 loss and grad norm against stock and the export round trip
# run for every causal-LM family in the conformance suite (tests/conformance/test_causal_lm_conformance.py).


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("attn", ["sdpa", "eager", "varlen"])
def test_packed_row_loss_equals_documents_computed_separately(attn, tiny_qwen3, tmp_path):
    """Document masking: a packed row's summed loss is the sum of each document's own loss (varlen: Spindle's
    per-document attention, spindle/ops/varlen_attention.py)."""
    from transformers import AutoModelForCausalLM

    from spindle.data.text import build_text_dataset
    from spindle.ops.varlen_attention import implementation_name, register
    from spindle.train.tasks.causal_lm import causal_lm_loss_sum

    _, tok = lm_stock(tiny_qwen3)
    register()
    model = AutoModelForCausalLM.from_pretrained(
        tiny_qwen3, dtype=torch.float32, attn_implementation=implementation_name(attn)
    )
    texts = ["the red circle moves left on a gray background", "a blue square", "then the big yellow star moves up"]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ds = build_text_dataset(f, tok, seq_len=40)
    assert len(ds) == 1
    row = {k: v.unsqueeze(0) for k, v in ds[0].items() if k != "index"}
    with torch.no_grad():
        packed = causal_lm_loss_sum(model, row)
        separate = 0.0
        for t in texts:
            ids = torch.tensor([[*tok(t).input_ids, tok.eos_token_id]])
            separate += model(ids, labels=ids).loss * (ids.shape[1] - 1)
        # The same row with one causal mask over everything (documents see each other): a different loss.
        crossing = causal_lm_loss_sum(model, {**row, "position_ids": torch.arange(40).unsqueeze(0)})
    assert float(packed) == pytest.approx(float(separate), rel=RTOL)
    assert float(crossing) != pytest.approx(float(separate), rel=1e-3)


def test_loss_is_the_global_token_mean_whatever_the_micro_batches(tiny_qwen3, lm_corpus, tmp_path):
    """Global batch 8 as 1x8, 4x2 and 8x1 micro-batches: the same step losses and grad norms, with
    rows holding very different numbers of learned tokens (chat rows learn only the assistant turns)."""
    from spindle.data.loader import ResumableLoader
    from spindle.data.text import build_text_dataset, collate_rows

    _, tok = lm_stock(tiny_qwen3)
    ds = build_text_dataset(lm_corpus, tok, seq_len=48, packing=False)
    loader = ResumableLoader(ds, 2, dp_rank=0, dp_size=1, seed=0, collate_fn=collate_rows)
    counts = {int((next(loader)["shift_labels"] != -100).sum()) for _ in range(4)}
    assert len(counts) > 1, "the test needs micro-batches with uneven learned-token counts"

    series = {}
    for micro in (8, 2, 1):
        out = tmp_path / f"mb{micro}"
        lm_train(
            tiny_qwen3, lm_corpus, out, data__packing=False, train__micro_batch_size=micro, checkpoint__export=False
        )
        series[micro] = read_metrics(out)
    for micro in (2, 1):
        for key in ("loss", "grad_norm"):
            got, want = [m[key] for m in series[micro]], [m[key] for m in series[8]]
            assert got == pytest.approx(want, rel=RTOL), (micro, key)


# ---------------------------------------------------------------- export


def test_export_is_split_into_shards_that_stock_transformers_reassembles(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from spindle.export.transformers import write_transformers_folder

    model, _ = lm_stock(tiny_llama)
    out = tmp_path / "sharded"
    write_transformers_folder(model, model.state_dict(), tiny_llama, out, max_shard_bytes=200_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------- config


def test_text_data_config_errors_name_the_key(tiny_qwen3, lm_corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'data.seq_length'; did you mean 'data.seq_len'"):
        load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path, data__seq_length=64))
    with pytest.raises(ConfigError, match=r"unknown key 'data.resolution'"):  # a DiT key on a language model
        load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path, data__resolution=[64, 64]))


def test_gradient_checkpointing_gives_the_same_run(tiny_llama, lm_corpus, tmp_path):
    lm_train(tiny_llama, lm_corpus, tmp_path / "plain", train__max_steps=2, checkpoint__export=False)
    lm_train(
        tiny_llama,
        lm_corpus,
        tmp_path / "ac",
        train__max_steps=2,
        train__gradient_checkpointing=True,
        checkpoint__export=False,
    )
    for key in ("loss", "grad_norm"):
        plain = [m[key] for m in read_metrics(tmp_path / "plain")]
        assert [m[key] for m in read_metrics(tmp_path / "ac")] == pytest.approx(plain, rel=1e-6), key


def test_demo_qwen3_trains_exports_and_continues_text(tmp_path):
    out = tmp_path / "demo"
    proc = run_spindle("demo", "--family", "qwen3", "--out", out, "--steps", 30, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = [m["loss"] for m in read_metrics(out / "run")]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    assert "continuation of 'the red circle'" in proc.stdout
    assert (out / "sample.txt").read_text().startswith("the red circle ")


@pytest.mark.parametrize("name", ["qwen3_tiny.yaml", "qwen3_0.6b.yaml"])
def test_shipped_configs_are_valid_causal_lm_jobs(name):
    from pathlib import Path

    from spindle.config import CausalLMJobConfig, load_raw, validate_config

    cfg = validate_config(load_raw(Path(__file__).parents[2] / "configs" / name), CausalLMJobConfig)
    assert cfg.data.packing and cfg.data.seq_len >= 64


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"parallel__ring": 2, "parallel__dp_shard": 1}, "set parallel.ring: 1"),
        ({"train__validation": {"every_steps": 1, "prompts": ["a"]}}, "train.validation.every_steps: 0"),
    ],
    ids=["ring", "validation"],
)
def test_dit_only_options_are_refused_for_language_models_before_launch(
    overrides, message, tiny_qwen3, lm_corpus, tmp_path, spindle_cli
):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("{}")
    args = lm_overrides(tiny_qwen3, lm_corpus, tmp_path / "o", **overrides)
    r = spindle_cli("train", cfg, *args, "--nproc", "2")
    assert r.returncode == 2
    assert message in r.stderr
    assert not (tmp_path / "o").exists()  # refused before any process was launched
