"""The conformance suite for causal-LM families: every one in the registry passes the same checks
(spindle/testing/causal_lm_conformance.py), so a new family is tested by registering it.

Per family (parametrised over `registry.all_families()` of the causal-LM kind): `spindle tiny-model`
writes a seeded checkpoint that stock transformers loads as the family's class and generates from; the
family's (patched) training class equals stock transformers on the same weights (loss and every
gradient with labels, shift_labels, num_items_in_batch and the summed reduction; logits exactly,
`logits_to_keep`, greedy generation); Spindle's step-1 loss and grad norm equal stock's
`model(ids, labels=ids)`; the export loads in AutoModelForCausalLM with every tensor equal to the
trained one; and on 2 processes each declared layout (dp_shard=2, SP=2, and EP=2 where the task
supports it) equals one process (slow). Family oddities (MoE router statistics and expert layouts,
KV-head repetition under SP, packing) stay in tests/train and tests/distributed.
"""

from __future__ import annotations

import pytest
import torch

from spindle.registry import all_families, get_family
from spindle.testing import causal_lm_conformance as suite
from tests.conftest import lm_train, lm_train_cli, run_spindle

FAMILIES = sorted(f.name for f in all_families() if f.kind == "causal_lm")
LAYOUTS = [(name, layout) for name in FAMILIES for layout in suite.parallel_layouts(get_family(name))]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    """`pair(name)`: (stock model, the family's training class) on its tiny checkpoint, once per module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = suite.stock_and_patched(get_family(name), tiny_checkpoint(name))
        return built[name]

    return get


def test_the_suite_covers_every_causal_lm_family():
    assert {"qwen3", "llama", "qwen3_moe"} <= set(FAMILIES)
    for name in FAMILIES:
        family = get_family(name)
        assert family.tiny_model and family.demo, f"{name}: the suite needs a tiny_model builder and a demo"


# ---------------------------------------------------------------- the tiny checkpoint


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_tiny_model_loads_in_stock_transformers(name, tmp_path, spindle_cli):
    out = tmp_path / name
    r = spindle_cli("tiny-model", name, out, "--seed", "3")
    assert r.returncode == 0, r.stderr
    suite.check_stock_load(get_family(name), out)


def test_registry_resolves_transformers_folders_by_model_type(tiny_checkpoint, tmp_path):
    import json

    from spindle.registry import UnknownModelError, resolve_family

    for name in FAMILIES:
        assert resolve_family(tiny_checkpoint(name)).name == name
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    # every transformers-folder family is listed (VLMs too), not only this kind's
    known = ", ".join(sorted(t for f in all_families() for t in getattr(f, "model_types", ())))
    with pytest.raises(UnknownModelError, match=rf"'gpt2'.*known model types: {known}$"):
        resolve_family(other)


# ---------------------------------------------------------------- the patched class equals stock transformers


@pytest.mark.parametrize("num_items_in_batch", [None, 13, torch.tensor(7)], ids=["mean", "items13", "items_tensor7"])
@pytest.mark.parametrize("name", FAMILIES)
def test_labels_loss_and_grads_equal_stock(name, num_items_in_batch, pair):
    stock, patched = pair(name)
    input_ids, labels = suite.token_batch(stock.config.vocab_size)
    kwargs = {"input_ids": input_ids, "labels": labels}
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    suite.check_same_loss_and_grads(get_family(name), stock, patched, kwargs, kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_shift_labels_equal_stock(name, pair):
    stock, patched = pair(name)
    input_ids, labels = suite.token_batch(stock.config.vocab_size, seed=1)
    shift = torch.roll(labels, -1, dims=1)  # already shifted, as Spindle's packed rows arrive
    shift[:, 5] = -100  # a document boundary: nothing to predict across it
    stock_kwargs = {"input_ids": input_ids, "labels": labels, "shift_labels": shift}
    patched_kwargs = {"input_ids": input_ids, "shift_labels": shift}
    suite.check_same_loss_and_grads(get_family(name), stock, patched, stock_kwargs, patched_kwargs)


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_reduction_sum_is_the_plain_sum(name, pair):
    stock, patched = pair(name)
    input_ids, labels = suite.token_batch(stock.config.vocab_size, seed=2)
    shift = torch.roll(labels, -1, dims=1)
    # Stock with num_items_in_batch=1 divides the sum by 1: the plain sum over valid tokens.
    stock_kwargs = {"input_ids": input_ids, "labels": labels, "shift_labels": shift, "num_items_in_batch": 1}
    patched_kwargs = {"input_ids": input_ids, "shift_labels": shift, "loss_reduction": "sum", "num_items_in_batch": 9}
    # the sum over N tokens is N x the mean: its gradients and their float error too (on an AVX-512 CPU one element
    # of gemma3's differed by 1.2e-6, past the mean's absolute tolerance)
    tokens = int((shift != -100).sum())
    suite.check_same_loss_and_grads(get_family(name), stock, patched, stock_kwargs, patched_kwargs, scale=tokens)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_path_and_generate_unchanged(name, pair):
    suite.check_logits_and_generate(get_family(name), *pair(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_bad_loss_reduction_names_the_kwarg(name, pair):
    _, patched = pair(name)
    input_ids, labels = suite.token_batch(patched.config.vocab_size)
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        patched(input_ids=input_ids, labels=labels, loss_reduction="avg")


# ---------------------------------------------------------------- training against stock transformers


@pytest.mark.parametrize("name", FAMILIES)
def test_step_one_loss_and_grad_norm_equal_stock_transformers(name, tiny_checkpoint, lm_step_one):
    suite.check_step_one(get_family(name), tiny_checkpoint(name), lm_step_one(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_export_loads_in_stock_transformers_with_every_tensor_equal(name, tiny_checkpoint, lm_corpus, tmp_path):
    family = get_family(name)
    trainer, result = lm_train(tiny_checkpoint(name), lm_corpus, tmp_path / "run", train__max_steps=2)
    assert sorted(p.name for p in result.export_dir.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert not (result.export_dir / "sharded").exists()
    trained = trainer.model.state_dict()
    exported = suite.check_export_round_trip(family, tiny_checkpoint(name), result.export_dir, trained)

    # `spindle export` of the final checkpoint writes the same weights on one process.
    cli = tmp_path / "cli_export"
    proc = run_spindle("export", result.output_dir, "--out", cli)
    assert proc.returncode == 0, proc.stderr
    again = suite.stock(cli)[0].state_dict()
    assert again.keys() == exported.keys() and all(torch.equal(again[k], exported[k]) for k in exported)


# ---------------------------------------------------------------- parallel layouts equal one process


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-{layout}" for n, layout in LAYOUTS])
def test_two_processes_equal_one(name, layout, tiny_checkpoint, lm_corpus, lm_reference_run, tmp_path):
    """The same steps, loss, grad norm (and declared stock outputs: an MoE's aux loss from the router
    statistics of all the ranks' tokens, not each rank's own; its expert load counting each token once)
    and exported weights as one process."""
    nproc, overrides = suite.LAYOUTS[layout]
    out = tmp_path / "run"
    lm_train_cli(tiny_checkpoint(name), lm_corpus, out, nproc, **suite.REFERENCE_RUN, **overrides)
    suite.check_same_run(get_family(name), lm_reference_run(name), out)
