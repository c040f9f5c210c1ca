"""The conformance suite for VLM families: every one in the registry passes the same checks
(spindle/testing/vlm_conformance.py), so a new family is tested by registering it.

Per family (parametrised over `registry.all_families()` of the VLM kind): `spindle tiny-model` writes a
seeded checkpoint that stock transformers loads as the family's class, with Qwen's special tokens and an
image processor, every parameter in one of the family's parts; Spindle's step-1 loss and grad norm (and
an MoE's aux loss) equal stock transformers' on one image conversation; a packed row's loss is its
documents' losses; a text-only micro-batch runs the vision tower with zero weight; `train.freeze` leaves
the frozen parts unchanged with no optimizer state; the export, from a bf16 input, keeps the input's
tensor names and precision, loads in AutoModelForImageTextToText with the trained weights and generates
from an image; and on 2 processes dp_shard=2 (one rank text-only), sp=2 and, for MoE families, ep=2
equal one process (slow). Family oddities stay in tests/train (Qwen2.5-VL and Qwen3-VL video, the MoE expert
layouts).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from spindle.api import load_job_config, make_trainer
from spindle.registry import all_families, get_family
from spindle.testing import causal_lm_conformance as lm_suite
from spindle.testing import vlm_conformance as suite
from tests.conftest import seeded_cli_tiny, single_process_runs, spindle_train, vlm_overrides, vlm_train

FAMILIES = sorted(f.name for f in all_families() if f.kind == "vlm")
LAYOUTS = [(name, layout) for name in FAMILIES for layout in suite.parallel_layouts(get_family(name))]
# train.freeze cases: (frozen, trained). Each family runs one, in turn, so that every case and every family's
# part prefixes are covered at the cost of one 2-step run per family.
FREEZE_CASES = [
    (["vision"], {"aligner", "language"}),
    (["vision", "language"], {"aligner"}),
    (["language"], {"vision", "aligner"}),
]
FREEZE = [(name, *FREEZE_CASES[i % len(FREEZE_CASES)]) for i, name in enumerate(FAMILIES)]


def test_the_suite_covers_every_vlm_family():
    assert {"qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"} <= set(FAMILIES)
    for name in FAMILIES:
        assert get_family(name).tiny_model, f"{name}: the suite needs a tiny_model builder"


# ---------------------------------------------------------------- the tiny checkpoint


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_tiny_model_is_seeded_and_loads_in_stock_transformers(name, tmp_path, spindle_cli):
    suite.check_stock_load(get_family(name), seeded_cli_tiny(spindle_cli, name, tmp_path))


# ---------------------------------------------------------------- training against stock transformers


@pytest.mark.parametrize("name", FAMILIES)
def test_step_one_loss_and_grad_norm_equal_stock_transformers(name, tiny_checkpoint, vlm_conversations, tmp_path):
    model = tiny_checkpoint(name)
    data = suite.subset(vlm_conversations, tmp_path / "data", [0])
    trainer, _ = vlm_train(model, data, tmp_path / "run", data__packing=False, train__max_steps=1)
    assert trainer.loader.dataset.stats.truncated == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    suite.check_step_one(get_family(name), model, data, logged)


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_row_loss_equals_the_documents_losses(name, tiny_checkpoint, vlm_conversations, tmp_path):
    """Three conversations (two with an image, one text-only) in one packed row: the summed token loss
    equals the sum of stock transformers' per-conversation losses, so neither attention nor 3-D positions
    cross documents (an MoE's router aux term is one statistic of the whole row, added as its task adds it).
    A model with linear-attention layers (whose state would cross documents), or a family refusing packing
    (`packing_refused`), refuses data.packing: true naming why, and its default is one conversation per row."""
    from spindle.config import ConfigError
    from spindle.train.packing import has_linear_attention, read_config

    model = tiny_checkpoint(name)
    data = suite.subset(vlm_conversations, tmp_path / "data", [0, 3, 1])
    if reason := get_family(name).packing_refused:
        with pytest.raises(ConfigError, match=rf"data\.packing: {name} models: {re.escape(reason)}"):
            make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "a", data__packing=True)))
        trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "b", data__seq_len=256)))
        assert trainer.loader.dataset.stats.rows == 3  # the default: one conversation per row
        return
    if has_linear_attention(read_config(model)):
        with pytest.raises(ConfigError, match=r"data\.packing: .* linear-attention \(Gated DeltaNet\) layers"):
            make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "a", data__packing=True)))
        trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "b", data__seq_len=256)))
        assert trainer.loader.dataset.stats.rows == 3  # the default: one conversation per row
        return
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "run", data__seq_len=256)))
    assert trainer.loader.dataset.stats.rows == 1
    batch = next(trainer.loader)
    images = batch["image_grid_thw"] if "image_grid_thw" in batch else batch["pixel_values"]  # Gemma 3: no grids
    assert images.shape[0] == 2
    out = trainer.task.forward(trainer.model, batch, 0)

    stock = suite.stock_model(model)
    total = sum(suite.stock_token_loss_sum(stock, inputs) for inputs in suite.stock_inputs(model, data))
    expected = total + suite.router_aux_term(trainer, out, trainer.task.loss_units(batch))
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_text_only_batch_runs_the_vision_tower_with_zero_weight(name, tiny_checkpoint, vlm_conversations, tmp_path):
    """A micro-batch with no image still runs the vision tower (what keeps FSDP2's collectives in step across
    ranks): its parameters get a gradient, all zeros, and the loss is stock transformers' text-only loss."""
    model = tiny_checkpoint(name)
    family = get_family(name)
    data = suite.subset(vlm_conversations, tmp_path / "data", [0, 3])  # line 3 is text-only
    trainer = make_trainer(load_job_config(None, vlm_overrides(model, data, tmp_path / "run", data__packing=False)))
    next(trainer.loader)
    batch = next(trainer.loader)
    assert "pixel_values" not in batch
    out = trainer.task.forward(trainer.model, batch, 0)
    out.loss_sum.backward()
    vision = [p for n, p in trainer.model.named_parameters() if n.startswith(family.vision_tower + ".")]
    assert vision and all(p.grad is not None and not p.grad.any() for p in vision)

    inputs = suite.stock_inputs(model, data)[1]
    expected = suite.stock_token_loss_sum(suite.stock_model(model), inputs)
    expected = expected + suite.router_aux_term(trainer, out, trainer.task.loss_units(batch))
    torch.testing.assert_close(out.loss_sum, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize(("name", "freeze", "trained"), FREEZE, ids=[f"{n}-{'+'.join(f)}" for n, f, _ in FREEZE])
def test_freeze_keeps_parts_unchanged_without_optimizer_state(
    name, freeze, trained, tiny_checkpoint, vlm_conversations, tmp_path
):
    family = get_family(name)
    model = tiny_checkpoint(name)
    trainer, _ = vlm_train(model, vlm_conversations, tmp_path / "run", **suite.freeze_overrides(freeze))
    before, after = (suite.stock_model(path).state_dict() for path in (model, tmp_path / "run" / "export"))
    suite.check_frozen_parts(family, trainer, before, after, trained)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", FAMILIES)
def test_export_keeps_the_input_layout_and_precision_and_generates_from_an_image(
    name, tiny_checkpoint, vlm_conversations, tmp_path, spindle_cli
):
    """From a bf16 checkpoint: the export is bf16 under the input's tensor names, stock transformers loads it
    with every tensor the trained one, and generates from an image; `spindle export` of the final checkpoint
    writes the same tensors."""
    from safetensors.torch import load_file

    family = get_family(name)
    base = suite.with_dtype(tiny_checkpoint(name), tmp_path / "bf16", torch.bfloat16)
    trainer, result = vlm_train(base, vlm_conversations, tmp_path / "run", train__max_steps=2)
    image = vlm_conversations.parent / "images" / "image_000.png"
    suite.check_export(family, base, result.export_dir, trainer.model.state_dict(), image)

    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    written, again = (load_file(p / "model-00001-of-00001.safetensors") for p in (result.export_dir, tmp_path / "cli"))
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
    assert (tmp_path / "cli" / "preprocessor_config.json").is_file()


# ---------------------------------------------------------------- parallel layouts equal one process


@pytest.fixture(scope="module")
def reference_data(vlm_conversations, tmp_path_factory):
    return suite.subset(vlm_conversations, tmp_path_factory.mktemp("vlm_rows"), suite.REFERENCE_LINES)


@pytest.fixture(scope="module")
def reference_run(reference_data, tiny_checkpoint, tmp_path_factory):
    """`reference_run(family)`: one process training REFERENCE_RUN (made on first use)."""
    return single_process_runs(
        lambda model, out: vlm_overrides(model, reference_data, out, **suite.REFERENCE_RUN),
        tiny_checkpoint,
        tmp_path_factory,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-{layout}" for n, layout in LAYOUTS])
def test_two_processes_equal_one(name, layout, tiny_checkpoint, reference_data, reference_run, tmp_path):
    """The same steps, losses, grad norms (and an MoE's aux loss and expert load) and exported weights as one
    process: FSDP2 over vision blocks and decoder layers with one rank's micro-batches text-only (its vision
    tower runs the zero-weight dummy forward, so collectives match and nothing hangs); Ulysses SP over the
    language model (3-D positions computed on whole documents before the split, vision and deepstack
    features cut with the sequence); EP over the experts."""
    out = tmp_path / "run"
    overrides = {**suite.REFERENCE_RUN, **suite.LAYOUTS[layout]}
    spindle_train(out, 2, vlm_overrides(tiny_checkpoint(name), reference_data, out, **overrides))
    lm_suite.check_same_run(get_family(name), reference_run(name), out)
