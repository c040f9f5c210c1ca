"""The conformance suite for omni families: every one in the registry passes the same checks
(spindle/testing/omni_conformance.py, which reuses the VLM suite's), so a new family is tested by registering it.

Per family (parametrised over `registry.all_families()` of the omni kind): `spindle tiny-model` writes a seeded
whole-model folder (thinker, talker, speech decoder) that the stock full model loads, with one
preprocessor_config.json for images and audio and every thinker parameter in one of the family's parts;
Spindle's step-1 loss and grad norm (and an MoE's aux loss) equal the stock thinker's on an audio conversation
and on one with an image before its clip; the export keeps the input's tensor names, dtypes and other files,
the untrained talker and speech decoder byte-identical, loads in the stock full model with the trained thinker
and answers an audio clip, and `spindle export` writes the same; and on 2 processes the family's layouts
(dp_shard=2 with an audio-free rank, sp=2 and, for MoE families, ep=2) equal one process (slow). Family
oddities stay in tests/train/test_omni*.py (videos with their audio track, freezing, LoRA, the expert layouts).
"""

from __future__ import annotations

import json

import pytest

from spindle.registry import all_families, get_family
from spindle.testing import omni_conformance as suite
from spindle.testing import vlm_conformance as vlm_suite
from tests.conftest import omni_overrides, omni_train, seeded_cli_tiny, single_process_runs, spindle_train

FAMILIES = sorted(f.name for f in all_families() if f.kind == "omni")
STEP_ONE = [(name, line) for name in FAMILIES for line in suite.STEP_ONE_LINES]
LAYOUTS = [(name, layout) for name in FAMILIES for layout in suite.parallel_layouts(get_family(name))]


def test_the_suite_covers_every_omni_family():
    assert {"qwen2_5_omni", "qwen3_omni_moe"} <= set(FAMILIES)
    for name in FAMILIES:
        assert get_family(name).tiny_model, f"{name}: the suite needs a tiny_model builder"


# ---------------------------------------------------------------- the tiny checkpoint


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_tiny_model_is_seeded_and_loads_in_the_stock_full_model(name, tmp_path, spindle_cli):
    suite.check_stock_load(get_family(name), seeded_cli_tiny(spindle_cli, name, tmp_path))


# ---------------------------------------------------------------- training against the stock thinker


@pytest.mark.parametrize(("name", "line"), STEP_ONE, ids=[f"{n}-{line}" for n, line in STEP_ONE])
def test_step_one_loss_and_grad_norm_equal_the_stock_thinker(name, line, tiny_checkpoint, omni_conversations, tmp_path):
    model = tiny_checkpoint(name)
    data = vlm_suite.subset(omni_conversations, tmp_path / "data", [suite.STEP_ONE_LINES[line]])
    trainer, _ = omni_train(model, data, tmp_path / "run", data__packing=False, train__max_steps=1)
    assert trainer.loader.dataset.stats.truncated == 0
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    suite.check_step_one(get_family(name), model, data, logged)


# ---------------------------------------------------------------- export


@pytest.mark.parametrize("name", FAMILIES)
def test_export_loads_in_the_stock_full_model_and_answers_an_audio_clip(
    name, tiny_checkpoint, omni_conversations, tmp_path, spindle_cli
):
    """Two steps on the four conversations, exported (suite.check_export); `spindle export` of the final
    checkpoint writes the same folder on one process."""
    family, base = get_family(name), tiny_checkpoint(name)
    trainer, _ = omni_train(base, omni_conversations, tmp_path / "run", train__max_steps=2)
    thinker = suite.check_export(family, base, tmp_path / "run", trainer.model.state_dict(), omni_conversations)

    r = spindle_cli("export", tmp_path / "run", "--out", tmp_path / "cli")
    assert r.returncode == 0, r.stderr
    suite.check_cli_export(family, base, tmp_path / "run" / "export", tmp_path / "cli", thinker)


# ---------------------------------------------------------------- parallel layouts equal one process


@pytest.fixture(scope="module")
def reference_data(omni_conversations, tmp_path_factory):
    return vlm_suite.subset(omni_conversations, tmp_path_factory.mktemp("omni_rows"), suite.REFERENCE_LINES)


@pytest.fixture(scope="module")
def reference_run(reference_data, tiny_checkpoint, tmp_path_factory):
    """`reference_run(family)`: one process training REFERENCE_RUN (made on first use)."""
    return single_process_runs(
        lambda model, out: omni_overrides(model, reference_data, out, **vlm_suite.REFERENCE_RUN),
        tiny_checkpoint,
        tmp_path_factory,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), LAYOUTS, ids=[f"{n}-{layout}" for n, layout in LAYOUTS])
def test_two_processes_equal_one(name, layout, tiny_checkpoint, reference_data, reference_run, tmp_path):
    """The same steps, losses, grad norms (and an MoE's aux loss and expert load) and exported thinker as one
    process, the talker and speech decoder as they came: FSDP2 over audio encoder layers, vision blocks and
    decoder layers with one rank's micro-batches audio-free (its audio encoder runs the zero-weight dummy
    forward, so the collectives match and nothing hangs); Ulysses SP over the decoder (positions computed on
    whole conversations before the split, audio and vision filled in first, an MoE's router statistics summed
    over the SP group); EP over the thinker's experts (all-to-all token exchange, exported per expert as the
    input stores them)."""
    out = tmp_path / "run"
    base = tiny_checkpoint(name)
    overrides = {**vlm_suite.REFERENCE_RUN, **suite.LAYOUTS[layout]}
    spindle_train(out, 2, omni_overrides(base, reference_data, out, **overrides))
    suite.check_same_run(get_family(name), base, reference_run(name), out)
