"""The conformance suite: every DiT family in the registry passes the same checks
(spindle/testing/conformance.py). A new family = its folder + registration + passing this module.

Per family (parametrised over `registry.all_families()`): `spindle tiny-model` writes a checkpoint
the registry resolves; the tiny checkpoint loads in stock diffusers with the components its
model_index.json names; inference equals the family's diffusers pipeline with and without
classifier-free guidance (CFG batched and as two forwards; the batched step is one forward);
declared options are checked with errors naming the family and field; the default request is the
diffusers pipeline's call defaults; `spindle generate` writes the png generate() returns (image
families); the condition model refuses bad pixel shapes and its training inputs are the
transformer's forward arguments; a few samples
overfit, with the token throughput counted as inference counts tokens; the export loads in stock
diffusers with every tensor equal to the trained one and Spindle on it equals diffusers; LoRA
adapters chosen per request equal each LoRA loaded alone; `spindle demo --objective flow_grpo` rolls out
and updates with the recorded log-probs recomputed exactly; Ulysses SP
and ring attention on 2 processes equal one process (slow). And a broken family fails it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spindle.api import load_generator, load_job_config
from spindle.contracts.family import import_object
from spindle.registry import all_families, get_family
from spindle.testing import conformance as suite
from spindle.testing.specs import dit_spec
from tests.conftest import train_overrides

FAMILIES = sorted(f.name for f in all_families() if f.task == "flow_matching")
PARITY = [(f, case) for f in FAMILIES for case in sorted(dit_spec(f).parity_cases)]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """`tiny(name)`: the family's seed-0 tiny checkpoint, built once per session (tests/conftest.py)."""
    return tiny_checkpoint


@pytest.mark.parametrize("name", FAMILIES)
def test_family_declares_what_the_suite_needs(name):
    family = get_family(name)
    assert family.tiny_model and family.demo and family.inference and dit_spec(name), name
    assert dit_spec(name).default_params, f"{name}: declare the diffusers pipeline's call defaults"
    if family.inference_spec().media == "image":
        assert dit_spec(name).cli_case, f"{name}: declare a `spindle generate` request (cli_case)"
    cases = dit_spec(name).parity_cases
    assert "nocfg" in cases, f"{name}: no parity case without guidance"
    if dit_spec(name).no_cfg:  # (its pipeline has none: no CFG case to run)
        assert "cfg" not in cases, f"{name}: a CFG case, but the family declares no_cfg"
    else:  # (that it enables CFG: test_cfg_batch_is_one_forward_equal_to_two)
        assert "cfg" in cases, f"{name}: no parity case with classifier-free guidance"


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_checkpoint_loads_in_stock_diffusers(name, tiny):
    suite.check_stock_load(get_family(name), tiny(name))


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
@pytest.mark.parametrize("name,case", PARITY, ids=[f"{f}-{c}" for f, c in PARITY])
def test_inference_equals_the_diffusers_pipeline(name, case, cfg_batch, tiny):
    family = get_family(name)
    suite.check_inference_parity(family, tiny(name), dit_spec(name).parity_cases[case], cfg_batch=cfg_batch)


def guided_case(name: str) -> dict:
    """The family's CFG case; a family without CFG (`ConformanceSpec.no_cfg`): its "nocfg" one."""
    cases = dit_spec(name).parity_cases
    return cases.get("cfg", cases["nocfg"])


@pytest.mark.parametrize("name", FAMILIES)
def test_adapters_chosen_per_request_equal_each_lora_alone(name, tiny, tmp_path):
    family = get_family(name)
    suite.check_runtime_adapters(family, tiny(name), tmp_path / "loras", guided_case(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_defaults_are_the_diffusers_pipeline_defaults(name, tiny):
    family = get_family(name)
    suite.check_default_params(family, tiny(name), dit_spec(name).default_params)


# `spindle generate` per image family (its ConformanceSpec.cli_case, with a flag of its own). A video
# family's mp4 is lossy: tests/infer/test_infer_cli.py.
IMAGE_FAMILIES = [f for f in FAMILIES if get_family(f).inference_spec().media == "image"]


@pytest.mark.parametrize("name", IMAGE_FAMILIES)
def test_generate_cli_writes_the_generated_png(name, tiny, tmp_path, spindle_cli):
    family = get_family(name)
    suite.check_generate_cli_png(family, tiny(name), tmp_path / f"{name}.png", dit_spec(name).cli_case, spindle_cli)


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_model_cli_writes_a_checkpoint_the_registry_resolves(name, tmp_path, spindle_cli):
    from spindle.registry import resolve_family

    r = spindle_cli("tiny-model", name, tmp_path / "m", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert resolve_family(tmp_path / "m").name == name


CFG_FAMILIES = [f for f in FAMILIES if not dit_spec(f).no_cfg]


@pytest.mark.parametrize("name", CFG_FAMILIES)
def test_cfg_batch_is_one_forward_equal_to_two(name, tiny):
    family = get_family(name)
    suite.check_cfg_batch_is_one_forward(family, tiny(name), dit_spec(name).parity_cases["cfg"])


BAD_REQUESTS = [(f, i) for f in FAMILIES for i in range(len(suite.request_error_cases(get_family(f))))]


@pytest.fixture(scope="module")
def generator(tiny):
    """`generator(name)`: `load_generator` of the family's tiny checkpoint, once per module."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = load_generator(tiny(name))
        return built[name]

    return get


def bad_request_id(name: str, row: int) -> str:
    kw = suite.request_error_cases(get_family(name))[row][0]
    return f"{name}-" + "-".join(f"{k}={v!r}" for k, v in kw.items())


@pytest.mark.parametrize("name,row", BAD_REQUESTS, ids=[bad_request_id(f, i) for f, i in BAD_REQUESTS])
def test_bad_requests_are_clear_errors(name, row, generator):
    """The shared bad-request table: the rows every family refuses alike, then the family's own rows
    (what its checkpoint bounds), each a RequestError naming the field, raised before any work."""
    family = get_family(name)
    kw, message = suite.request_error_cases(family)[row]
    field = "negative_prompt" if "negative_prompt" in kw else next(iter(kw))  # the field the row makes bad
    suite.check_request_error(generator(name), {**dit_spec(name).parity_cases["nocfg"], **kw}, message, field)


@pytest.mark.parametrize("name", FAMILIES)
def test_bad_options_are_clear_request_errors(name, tiny):
    suite.check_request_errors(get_family(name), tiny(name))


def cache_case(name: str) -> dict:
    """The family's CFG case (`guided_case`) with its `cache_steps` (3: the step cache has two steps to skip)."""
    return {**guided_case(name), "num_inference_steps": dit_spec(name).cache_steps}


# the families whose transformer diffusers' first-block cache can run (FLUX.2's spec names why it cannot: its
# refusal is tests/infer/test_flux2.py's)
FBC_FAMILIES = [f for f in FAMILIES if get_family(f).inference_spec().cache_unavailable("fbc") is None]


@pytest.mark.parametrize("cfg_batch", [True, False], ids=["cfg_batch", "two_forwards"])
@pytest.mark.parametrize("name", FBC_FAMILIES)
def test_step_cache_threshold_zero_is_exact(name, cfg_batch, tiny):
    suite.check_step_cache_exact(get_family(name), tiny(name), cache_case(name), cfg_batch=cfg_batch)


@pytest.mark.parametrize("name", FBC_FAMILIES)
def test_step_cache_large_threshold_skips_blocks(name, tiny):
    suite.check_step_cache_skips(get_family(name), tiny(name), cache_case(name))


def _one_per_transformer() -> list[str]:
    """The first family of each (transformer class, two-expert or not): regional compile compiles the
    transformer's repeated blocks, the same code for every family that shares the class (a variant changes
    the inputs, not the blocks); a two-expert checkpoint has two transformers to compile."""
    seen: dict[tuple[str, bool], str] = {}
    for name in FAMILIES:
        checkpoint = get_family(name).checkpoint
        seen.setdefault((checkpoint.transformer, checkpoint.variant is not None), name)
    return sorted(seen.values())


@pytest.mark.parametrize("name", _one_per_transformer())
def test_regional_compile_matches_eager(name, tiny):
    suite.check_compile_matches_eager(get_family(name), tiny(name), cache_case(name))


# the families whose condition model declares the longest prompt its pipeline takes (FLUX.2 reads its tokenizer's;
# Wan I2V's transformer fixes the length: tests/train/test_wan_i2v_train.py)
TEXT_LIMITED = [f for f in FAMILIES if getattr(get_family(f).condition_model_cls(), "max_text_limit", None)]


@pytest.mark.parametrize("name", TEXT_LIMITED)
def test_a_text_length_past_the_pipelines_limit_is_refused_naming_it(name, tiny):
    """`model.max_text_length` past what the family's pipeline takes is refused when the condition model is built
    (before any training), naming the key and the bound."""
    cls = get_family(name).condition_model_cls()
    limit = cls.max_text_limit
    with pytest.raises(ValueError, match=rf"model\.max_text_length must be between 1 and {limit}"):
        cls.from_pretrained(tiny(name), max_text_length=limit + 1)


@pytest.mark.parametrize("name", FAMILIES)
def test_condition_model_rejects_bad_pixels(name, tiny):
    suite.check_condition_rejects_bad_pixels(get_family(name), tiny(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_training_inputs_are_the_transformers_arguments(name, tiny):
    suite.check_training_inputs(get_family(name), tiny(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_overfits_and_exports_for_stock_diffusers(name, tiny, tmp_path):
    from spindle.api import make_trainer
    from spindle.train.metrics import read_metrics

    family = get_family(name)
    data = import_object(family.demo.dataset)(tmp_path / "data", seed=0, **family.demo.dataset_kwargs)
    # a few samples at the family's demo size, a high learning rate: the loss must clearly fall
    overrides = train_overrides(
        tiny(name), data, tmp_path / "run",
        data__resolution=list(family.demo.size), data__num_frames=family.demo.num_frames,
        model__max_text_length=suite.text_tokens(family), train__max_steps=12, train__global_batch_size=2, train__micro_batch_size=2, train__lr=3e-3, train__seed=0,
        train__ema__decay=0.9, export__weights="both",  # the EMA beside the trained transformer (train.ema)
        **dit_spec(name).train_overrides,
    )  # fmt: skip
    trainer = make_trainer(load_job_config(None, overrides))
    result = trainer.run()
    records = read_metrics(result.output_dir)
    suite.check_overfit(family, [m["loss"] for m in records])
    # the throughput metrics count the tokens the transformer sees, as inference counts them
    tokens = suite.inference_tokens(tiny(name), *family.demo.size, family.demo.num_frames)
    assert records[0]["tokens_per_s"] / records[0]["samples_per_s"] == pytest.approx(tokens)
    trained = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in trainer.model.state_dict().items()
    }
    suite.check_export_round_trip(family, tiny(name), result.export_dir, trained)
    suite.check_ema_export(family, result.export_dir, trainer.ema.state_dict())
    # Spindle's engine on the export still equals the stock pipeline on it
    suite.check_inference_parity(family, result.export_dir, dit_spec(name).parity_cases["nocfg"])


@pytest.mark.parametrize("name", FAMILIES)
def test_demo_runs_end_to_end(name, tmp_path, spindle_cli):
    """`spindle demo --family NAME` (two steps): tiny model, data, fine-tune, an export of the family's stock
    pipeline class, a sample from it at the demo size (a two-expert checkpoint names the expert it fine-tunes in its
    demo spec). That the loss falls is `test_overfits_and_exports_for_stock_diffusers`'s."""
    import json

    import numpy as np
    from PIL import Image

    family = get_family(name)
    result = spindle_cli("demo", "--family", name, "--steps", 2, "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    pipeline = family.checkpoint.pipeline
    assert f"{pipeline}.from_pretrained loads it" in result.stdout and "done in" in result.stdout
    assert json.loads((tmp_path / "run" / "export" / "model_index.json").read_text())["_class_name"] == pipeline
    sample = tmp_path / f"sample{family.demo.sample_suffix}"
    assert sample.is_file()
    if family.demo.sample_suffix == ".png":  # the demo size
        assert np.asarray(Image.open(sample)).shape == (*family.demo.size, 3)


@pytest.mark.parametrize("name", FAMILIES)
def test_diffusion_dpo_trains_a_step_from_the_demo_data(name, tiny, tmp_path):
    """`train.objective: diffusion_dpo` on pairs of the family's demo samples (an edit family's with their source
    images, an image-to-video family's conditioned on their first frame): step 1 at exactly log 2 (the policy is
    the reference) with a gradient."""
    import json
    import math

    from spindle.api import make_trainer
    from spindle.data.datasets import build_dataset
    from spindle.train.metrics import read_metrics

    family = get_family(name)
    demo = family.demo
    data = demo.write_data(tmp_path / "data", seed=0)
    samples = build_dataset(data, demo.size, demo.num_frames, check=False).samples
    lines = [
        {"prompt": a.caption, "chosen": str(a.path), "rejected": str(b.path)}
        | ({"image": [str(p) for p in a.sources]} if a.sources else {})
        for a, b in zip(samples[0:4:2], samples[1:4:2], strict=True)
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    overrides = train_overrides(
        tiny(name), pairs, tmp_path / "run",
        data__resolution=list(demo.size), data__num_frames=demo.num_frames,
        model__max_text_length=suite.text_tokens(family), train__max_steps=1, train__global_batch_size=2,
        train__micro_batch_size=2, train__objective="diffusion_dpo", **dit_spec(name).train_overrides,
    )  # fmt: skip
    result = make_trainer(load_job_config(None, overrides)).run()
    (metrics,) = read_metrics(result.output_dir)
    assert metrics["loss"] == pytest.approx(math.log(2), rel=1e-6) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_flow_grpo_demo_rolls_out_on_the_live_weights(name, tmp_path, spindle_cli):
    """`spindle demo --family NAME --objective flow_grpo` (the command a user runs): Flow-GRPO rollouts from the
    engine on the live transformer, the conditioning image the family's requests take, the family's demo sampling
    options; the recorded log-probs are the update's (mismatch <= 1e-5) and the update moves the weights."""
    from spindle.train.metrics import read_metrics

    result = spindle_cli("demo", "--family", name, "--objective", "flow_grpo", "--steps", 2, "--out", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["logprob_mismatch"] <= 1e-5 and m["grad_norm"] > 0 for m in metrics), metrics
    assert "mean reward per step" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_ulysses_and_ring_on_two_processes_equal_one(name, tiny, tmp_path, spindle_cli):
    from spindle.testing.multiprocess import spawn

    family = get_family(name)
    layouts = {"ulysses2": {"sp": 2}, "ring2": {"ring": 2}}
    layouts = {k: v for k, v in layouts.items() if k in dit_spec(name).sequence_parallel}
    if not layouts:
        # a transformer without a context-parallel plan (Z-Image's takes lists of variable-length samples):
        # the family trains without SP, and asking for it is refused before launch, saying why
        from spindle.api import check_job_plan

        for layout in ({"parallel__sp": 2}, {"parallel__ring": 2}):
            cfg = load_job_config(None, train_overrides(tiny(name), tmp_path / "data", tmp_path / "run", **layout))
            with pytest.raises(ValueError, match="has no context-parallel plan"):
                check_job_plan(cfg, 2)
        # and so does `spindle generate --nproc 2 --sp 2`, from the folder alone (no launch, no load)
        r = spindle_cli(
            "generate", "--model", tiny(name), "--prompt", "x", "--out", tmp_path / "x", "--nproc", 2, "--sp", 2
        )
        reason = family.sequence_parallel_refused or "has no context-parallel plan"
        assert r.returncode == 2 and r.stderr.startswith("spindle generate: error: --sp 2: "), r.stderr
        assert reason in r.stderr, r.stderr
        return
    assert "ulysses2" in layouts, f"{name}: a family with SP trains with Ulysses SP"
    if "ring2" not in layouts:  # Ulysses but not ring (LTX-2's per-head text mask): refused before launch, saying why
        from spindle.api import check_job_plan

        assert family.ring_attention_refused, f"{name} leaves ring2 out without a reason (ring_attention_refused)"
        cfg = load_job_config(None, train_overrides(tiny(name), tmp_path / "data", tmp_path / "run", parallel__ring=2))
        with pytest.raises(ValueError, match="runs without ring attention"):
            check_job_plan(cfg, 2)
        r = spindle_cli(
            "generate", "--model", tiny(name), "--prompt", "x", "--out", tmp_path / "x", "--nproc", 2, "--ring", 2
        )
        assert r.returncode == 2 and family.ring_attention_refused in r.stderr, r.stderr
    out = tmp_path / "sp.pt"
    spawn(suite.sp_worker, 2, name, str(tiny(name)), layouts, str(out))
    results = torch.load(out, weights_only=False)
    reference = suite.sp_reference(family, tiny(name))
    for layout in layouts:
        suite.check_sequence_parallel(family, reference, results[layout], layout)


@pytest.mark.parametrize("name", FAMILIES)
def test_precomputed_conditions_need_no_encoders(name, tiny):
    suite.check_precomputed_condition_model(get_family(name), tiny(name))


@pytest.mark.parametrize("name", FAMILIES)
def test_lora_targets_and_diffusers_lora_file(name, tiny, tmp_path):
    suite.check_lora_file_round_trip(get_family(name), tiny(name), tmp_path / "lora")


# ---------------------------------------------------------------- the suite can fail


def test_a_broken_family_fails_the_suite(tiny, monkeypatch):
    """A family whose inference spec decodes with the wrong latent scale, and whose condition model
    hands the transformer an argument it does not take, is caught by the checks above."""
    from spindle.models.wan import conformance as wan_conformance

    wan = get_family("wan")
    # the broken record (in Wan's folder) declares Wan's conformance spec, found by its name
    monkeypatch.setattr(wan_conformance, "BROKEN", wan_conformance.WAN, raising=False)
    spec = wan.inference_spec()

    class OffByAPercent(type(spec)):
        def decode_scale_shift(self, vae, latents):
            scale, shift = super().decode_scale_shift(vae, latents)
            return scale * 1.01, shift

    broken_spec = OffByAPercent()
    module = type("BrokenModule", (), {"SPEC": broken_spec})
    import sys

    sys.modules["spindle_test_broken_family"] = module  # import_object resolves "module:attr"
    broken = dataclasses.replace(
        wan, name="broken", package="spindle.models.wan", code={"inference": "spindle_test_broken_family:SPEC"}
    )
    case = dit_spec("wan").parity_cases["nocfg"]
    try:
        with pytest.raises(AssertionError, match="broken: Spindle differs from diffusers"):
            suite.check_inference_parity(broken, tiny("wan"), case)
    finally:
        del sys.modules["spindle_test_broken_family"]

    condition_cls = wan.condition_model_cls()

    class ExtraInput(condition_cls):
        def training_inputs(self, conditions, generators):
            return {**super().training_inputs(conditions, generators), "attention_kwargs_typo": None}

    with pytest.raises(AssertionError, match=r"broken: training inputs \['attention_kwargs_typo'\]"):
        suite.check_training_inputs(
            broken, tiny("wan"), condition=ExtraInput.from_pretrained(tiny("wan"), max_text_length=16)
        )
