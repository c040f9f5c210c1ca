"""Packed-row attention without an [S, S] mask (spindle/ops/varlen_attention.py) and the attention setting
(`model.attn_implementation`, spindle/ops/attention_backend.py).

- Every causal-LM family's training class: the varlen path equals transformers' dense-mask sdpa path on
  packed rows whose rows differ in layout (loss and every gradient, 1e-6), and the documents matter
  (plain causal attention over the row gives another loss); a family with sliding-window layers is refused.
- A VLM and an omni family through their tasks (model.attn_implementation: sdpa vs varlen, one packed row
  of conversations with images / audio): the same loss and gradients (1e-6).
- The packed step never creates a tensor with two sequence-length dims (a dispatch probe that sees the
  dense path's mask), and the row of 16 documents equals the same documents as 16 unpacked rows.
- The setting: auto picks varlen on CPU and sdpa for sliding-window models; a choice that cannot run is
  refused before any work, with the reason; a DiT job refuses it.
(Ulysses SP with the varlen inner function: tests/distributed/test_ulysses_attention.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spindle.api import load_job_config, make_trainer
from spindle.config import ConfigError
from spindle.ops import attention_backend
from spindle.ops import varlen_attention as va
from spindle.ops.attention_backend import resolve_attention
from spindle.registry import all_families, get_family
from spindle.testing import vlm_conformance as vlm_suite
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, omni_overrides, vlm_overrides

LM_FAMILIES = sorted(f.name for f in all_families() if f.kind == "causal_lm")
# dense families of each multimodal kind (the MoE ones run the same language-model attention)
MULTIMODAL = [("qwen2_5_vl", "vlm"), ("qwen3_vl", "vlm"), ("qwen2_5_omni", "omni")]
EXACT = dict(rtol=1e-6, atol=1e-6)  # the tasks give summed losses (hundreds): 1e-6 relative
# the multimodal tasks' gradients, after attention per document (varlen) or one masked attention over the rows
# (dense), each summing in its own order over the batch's rows cut to the longest (spindle.data.text.trim_padding):
# up to 1.3e-6 absolute / 1e-5 relative measured on Qwen3-VL (embedding rows, the patch embedding's bias) -> the
# suite's fp32 parity tolerance
GRADS = dict(rtol=1e-5, atol=1e-5)


def packed_rows(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of 40 tokens: documents 10 + 25 + 5 and 30 + 10 (different layouts: per-row kernels)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 40), generator=g)
    pos = torch.stack(
        [
            torch.cat([torch.arange(10), torch.arange(25), torch.arange(5)]),
            torch.cat([torch.arange(30), torch.arange(10)]),
        ]
    )
    return {"input_ids": ids, "position_ids": pos}


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = batch["input_ids"]
    out = model(input_ids=ids, position_ids=batch["position_ids"], labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a: tuple, b: tuple, what: str, grads: dict | None = None) -> None:
    torch.testing.assert_close(b[0], a[0], **EXACT, msg=lambda m: f"{what} loss: {m}")
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        tol = grads or EXACT
        torch.testing.assert_close(b[1][name], a[1][name], **tol, msg=lambda m, n=name: f"{what} grad {n}: {m}")


@pytest.mark.parametrize("name", LM_FAMILIES)
def test_varlen_equals_the_dense_mask_path_on_every_causal_lm_family(name, tiny_checkpoint):
    family = get_family(name)
    sdpa = attention_backend.supports_sdpa(family.model_cls())  # GPT-OSS's sinks: eager, as Spindle builds it
    model = family.model_cls().from_pretrained(
        tiny_checkpoint(name), dtype=torch.float32, attn_implementation="sdpa" if sdpa else "eager"
    )
    batch = packed_rows(model.config.vocab_size)
    dense = loss_and_grads(model, batch)
    va.use_attention(model, va.implementation_name("varlen"))
    assert model.config._attn_implementation == "spindle_varlen"
    if not sdpa:
        # attention sinks (GPT-OSS): varlen computes plain softmax attention, so it refuses rather than drop them
        # (`auto` picks eager for such a model; its packed rows: test_one_packed_row_equals_the_documents_as_unpacked_rows)
        with pytest.raises(ValueError, match=r"sink logit per head.*set model.attn_implementation: auto"):
            loss_and_grads(model, batch)
        return
    if attention_backend.has_sliding_window(model.config):
        # sliding-window layers (Gemma 3): varlen has no window, so it refuses rather than attend past it
        # (`auto` picks sdpa for such a model; its packed rows: test_one_packed_row_equals_the_documents_as_unpacked_rows)
        with pytest.raises(ValueError, match=r"sliding window.*set model.attn_implementation: sdpa"):
            loss_and_grads(model, batch)
        return
    assert_same(dense, loss_and_grads(model, batch), name)
    # the documents matter: one causal sequence per row would give another loss
    plain = loss_and_grads(model, {**batch, "position_ids": torch.arange(40).expand(2, 40)})
    assert not torch.allclose(plain[0], dense[0], rtol=0, atol=1e-4)


def task_loss_and_grads(overrides: list[str], language: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The task's forward + backward of the first (packed) row of a run's data, whose language model runs
    the attention `language` (the towers keep transformers' sdpa)."""
    trainer = make_trainer(load_job_config(None, overrides))
    family = trainer.family
    lm = trainer.model.get_submodule(family.language_model)
    assert lm.config._attn_implementation == language
    assert trainer.model.get_submodule(family.vision_tower).config._attn_implementation == "sdpa"
    assert trainer.loader.dataset.stats.rows == 1
    batch = next(trainer.loader)
    assert int((batch["position_ids"][0, 0] == 0).sum()) >= 2, "the row packs several documents"
    out = trainer.task.forward(trainer.model, batch, 0)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return out.loss_sum.detach(), grads


@pytest.mark.parametrize(("name", "kind"), MULTIMODAL, ids=[n for n, _ in MULTIMODAL])
def test_varlen_equals_the_dense_mask_path_on_multimodal_families(
    name, kind, tiny_checkpoint, vlm_conversations, omni_conversations, tmp_path
):
    model = tiny_checkpoint(name)
    if kind == "vlm":  # two image conversations and a text-only one
        data, make, seq = vlm_suite.subset(vlm_conversations, tmp_path / "data", [0, 3, 1]), vlm_overrides, 256
    else:  # an audio clip, then an image then audio
        data, make, seq = vlm_suite.subset(omni_conversations, tmp_path / "data", [0, 2]), omni_overrides, 256
    runs = {}
    for setting in ("sdpa", "varlen"):
        runs[setting] = task_loss_and_grads(
            make(model, data, tmp_path / setting, data__seq_len=seq, model__attn_implementation=setting),
            va.implementation_name(setting),
        )
    assert_same(runs["sdpa"], runs["varlen"], name, grads=GRADS)


# ---------------------------------------------------------------- no [S, S] tensor


class SquareProbe(TorchDispatchMode):
    """Records every op whose output has two dims of the row length `s` (a dense [.., S, S] mask or score)."""

    def __init__(self, s: int):
        super().__init__()
        self.s, self.seen = s, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and list(t.shape).count(self.s) >= 2:
                self.seen.append((str(func), tuple(t.shape)))
        return out


def test_the_packed_step_never_creates_an_s_by_s_tensor(tiny_checkpoint):
    s = 257  # no other dim of the tiny model is 257
    model = (
        get_family("qwen3")
        .model_cls()
        .from_pretrained(tiny_checkpoint("qwen3"), dtype=torch.float32, attn_implementation="sdpa")
    )
    g = torch.Generator().manual_seed(1)
    batch = {
        "input_ids": torch.randint(0, model.config.vocab_size, (1, s), generator=g),
        "position_ids": torch.cat([torch.arange(100), torch.arange(100), torch.arange(57)])[None],
    }
    with SquareProbe(s) as dense:  # the probe sees today's dense mask
        loss_and_grads(model, batch)
    assert dense.seen
    va.use_attention(model, va.implementation_name("varlen"))
    with SquareProbe(s) as varlen:
        loss_and_grads(model, batch)
    assert varlen.seen == []


# deepseek_v3: multi-head latent attention (value heads of another size than query/key heads) and a MoE
# without a router aux loss, whose routing is per token: packing changes nothing
# gemma3: sliding-window layers (an 8-token window on the tiny model), packed through transformers' sdpa with
# its per-document mask windowed on the local layers (what `auto` picks for it; varlen has no window)
# gpt_oss: attention sinks and sliding-window layers, packed through transformers' eager attention (what `auto`
# picks: transformers refuses sdpa for the sinks) with the per-document mask its patched model builds from the
# position ids (upstream's passes none to the mask functions), and per-token router statistics in the aux loss
@pytest.mark.parametrize(
    "name,attention", [("qwen3", "varlen"), ("deepseek_v3", "varlen"), ("gemma3", "auto"), ("gpt_oss", "auto")]
)
def test_one_packed_row_equals_the_documents_as_unpacked_rows(name, attention, tiny_checkpoint, tmp_path):
    """The step-1 loss and grad norm of 4 documents packed in one row equal the same documents as 4 rows."""
    from transformers import AutoTokenizer

    model = tiny_checkpoint(name)
    tokenizer = AutoTokenizer.from_pretrained(model)
    words = ["river", "stone", "cloud", "seven", "north", "quiet", "alpha"]
    docs = [" ".join(words[(i + j) % 7] for j in range(8 + 3 * i)) for i in range(4)]
    # every document with its EOS fits a 64-token row, all four one 256-token row (padding is never learned)
    assert all(len(tokenizer(d)["input_ids"]) < 64 for d in docs)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    common = dict(data__shuffle=False, train__max_steps=1, checkpoint__export=False)
    packed = lm_overrides(
        model, data, tmp_path / "packed", data__seq_len=256, train__global_batch_size=1, train__micro_batch_size=1,
        model__attn_implementation=attention, **common,
    )  # fmt: skip
    rows = lm_overrides(
        model, data, tmp_path / "rows", data__seq_len=64, data__packing=False, train__global_batch_size=4,
        train__micro_batch_size=4, **common,
    )  # fmt: skip
    trainers = [make_trainer(load_job_config(None, overrides)) for overrides in (packed, rows)]
    assert [t.loader.dataset.stats.rows for t in trainers] == [1, 4]
    for trainer in trainers:
        trainer.run()
    a, b = read_metrics(tmp_path / "packed")[0], read_metrics(tmp_path / "rows")[0]
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


# ---------------------------------------------------------------- the setting


QWEN3 = {"num_attention_heads": 4, "layer_types": ["full_attention"] * 2}
SLIDING = {"num_attention_heads": 4, "layer_types": ["sliding_attention", "full_attention"]}


def test_auto_picks_varlen_on_cpu_and_sdpa_for_sliding_window_models():
    assert resolve_attention("auto", device_type="cpu", precision="no", text_config=QWEN3) == "varlen"
    assert resolve_attention("auto", device_type="cpu", precision="no", text_config=SLIDING) == "sdpa"
    assert resolve_attention("sdpa", device_type="cpu", precision="no", text_config=SLIDING) == "sdpa"
    # a class transformers refuses sdpa for (GPT-OSS's sinks): eager, and sdpa / varlen refused naming why
    sinks = get_family("gpt_oss").model_cls()
    assert (
        resolve_attention("auto", device_type="cpu", precision="no", text_config=SLIDING, model_class=sinks) == "eager"
    )
    for setting in ("sdpa", "varlen"):
        with pytest.raises(ValueError, match=f"{setting}: transformers refuses sdpa for GptOssForCausalLM.*sink"):
            resolve_attention(setting, device_type="cpu", precision="no", text_config=SLIDING, model_class=sinks)


@pytest.mark.parametrize(
    ("setting", "device", "config", "match"),
    [
        ("varlen", "cpu", SLIDING, "sliding-window layers.*set model.attn_implementation: sdpa"),
        ("flash_attention_2", "cpu", QWEN3, "runs on CUDA only.*use varlen"),
        ("flash_attention_3", "cpu", QWEN3, "runs on CUDA only"),
        ("flex_attention", "cpu", QWEN3, "runs on CUDA only"),
        ("flash_attention_2", "cuda", QWEN3, "'flash_attn' module is not installed"),
    ],
)
def test_a_setting_that_cannot_run_is_refused_with_the_reason(setting, device, config, match, monkeypatch):
    monkeypatch.setattr(attention_backend, "installed", lambda kernel: False)
    with pytest.raises(ValueError, match=f"model.attn_implementation={setting}: .*{match}"):
        resolve_attention(setting, device_type=device, precision="bf16", text_config=config)


def test_the_job_refuses_it_before_the_model_is_built(tiny_checkpoint, tmp_path):
    overrides = lm_overrides(tiny_checkpoint("qwen3"), tmp_path / "none.jsonl", tmp_path / "run")
    cfg = load_job_config(None, [*overrides, "model.attn_implementation=flash_attention_2"])
    with pytest.raises(ConfigError, match="flash_attention_2: runs on CUDA only"):
        make_trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_a_dit_job_refuses_the_language_model_setting(tiny_wan, tmp_path):
    with pytest.raises(ConfigError, match=r"model\.attn_implementation=varlen applies to language models"):
        load_job_config(None, [f"model.path={tiny_wan}", f"data.path={tmp_path}", "model.attn_implementation=varlen"])
