"""`train.objective: dpo` end to end: Spindle's trainer (the DPO part on the causal-LM task) against TRL's
`DPOTrainer`, the reference choices (another folder, the starting weights frozen, a LoRA run's adapters off),
the export, the refusals before launch, and a two-process FSDP2 layout equal to one process."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spindle.config import ConfigError
from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides, lm_train, lm_train_cli, load_job_config, spindle_train_killed
from tests.train.test_preference_trl_parity import LINES, SEQ_LEN, trl_step_one

PAIRS = [
    *LINES["standard"],
    {"prompt": "Capital of France:", "chosen": " Paris", "rejected": " Rome, surely"},
    {"prompt": "Is water wet?", "chosen": " Yes.", "rejected": " Never."},
    {"prompt": "1+1=", "chosen": "2", "rejected": "11"},
    {"prompt": "Say hi", "chosen": " hi", "rejected": " bye now"},
    {"prompt": "Best pet:", "chosen": " a cat", "rejected": " a rock"},
]


@pytest.fixture(scope="module")
def reference_qwen3(tmp_path_factory):
    """Another tiny Qwen3 (seed 1): a reference that is not the starting policy."""
    from spindle.testing.tiny import build_tiny

    return build_tiny("qwen3", tmp_path_factory.mktemp("dpo-ref") / "qwen3_ref", seed=1)


def pairs_file(tmp_path, lines):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def dpo_overrides(n: int, **values):
    return {
        "train__objective": "dpo",
        "data__seq_len": SEQ_LEN,
        "data__shuffle": False,
        "train__global_batch_size": n,
        "train__micro_batch_size": n,
        **values,
    }


def test_step_one_with_a_reference_model_equals_trl_and_the_export_loads(tiny_qwen3, reference_qwen3, tmp_path):
    """The hidden check's shape: a Qwen3 policy, a *different* reference given as dpo.reference_model, preference
    pairs: step 1's loss and grad norm equal trl.DPOTrainer's (1e-5 / 1e-4); 3 steps run; stock transformers
    loads the export and generates."""
    lines = LINES["standard"]
    data = pairs_file(tmp_path, lines)
    lm_train(
        tiny_qwen3,
        data,
        tmp_path / "run",
        **dpo_overrides(len(lines), dpo__reference_model=reference_qwen3, dpo__beta=0.1, train__max_steps=3),
    )
    metrics = read_metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    loss, norm = trl_step_one(tiny_qwen3, reference_qwen3, tokenizer, lines, "sigmoid", 0.1, None, tmp_path)
    assert metrics[0]["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert metrics[0]["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    assert {"rewards/chosen", "rewards/rejected", "margin", "accuracy"} <= set(metrics[0])
    assert metrics[2]["loss"] != metrics[0]["loss"]  # it trains
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "export", dtype=torch.float32)
    ids = tokenizer("The sky is", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


@pytest.mark.parametrize("lora", [False, True])
def test_the_default_reference_is_the_starting_policy(lora, tiny_qwen3, tmp_path):
    """Without dpo.reference_model the reference is the starting weights: a frozen copy (full fine-tune) or the
    policy with its adapters switched off (LoRA, whose B starts at zero). Step 1's log-ratios are then 0: loss
    log 2 and zero rewards exactly; later steps move away from it, so the reference stayed where it started."""
    data = pairs_file(tmp_path, PAIRS)
    lora_override = {"train__lora": {"rank": 4}} if lora else {}
    lm_train(
        tiny_qwen3,
        data,
        tmp_path / "run",
        **dpo_overrides(4, train__max_steps=3, train__lr=1e-2, checkpoint__export=False, **lora_override),
    )
    first, *_, last = read_metrics(tmp_path / "run")
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == pytest.approx(0, abs=1e-7) and first["margin"] == pytest.approx(0, abs=1e-7)
    assert abs(last["margin"]) > 1e-4


def test_simpo_step_one_equals_trl_cpo_with_its_default_gamma(tiny_qwen3, tmp_path):
    """loss_type simpo without dpo.gamma: TRL's target margin (CPOConfig.simpo_gamma 0.5), no reference model.
    Step 1 through the trainer equals `CPOTrainer.cpo_loss` on the starting policy's average log-probabilities."""
    from spindle.data.preference import collate_pairs, preference_pairs
    from spindle.train.objectives.logprobs import sequence_log_probs, token_log_probs_from_logits
    from tests.train.test_objectives import cpo_loss

    lines = LINES["standard"]
    data = pairs_file(tmp_path, lines)
    lm_train(
        tiny_qwen3,
        data,
        tmp_path / "run",
        **dpo_overrides(
            len(lines), dpo__loss_type="simpo", dpo__beta=2.0, train__max_steps=1, checkpoint__export=False
        ),
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    pairs, _ = preference_pairs(data, tokenizer, seq_len=SEQ_LEN)
    batch = collate_pairs(pairs, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sums, tokens = sequence_log_probs(token_log_probs_from_logits(logits, batch["shift_labels"]), batch["shift_labels"])
    losses, _, _ = cpo_loss(*(sums / tokens).chunk(2), "simpo", 2.0, 0.0, gamma=0.5)
    assert read_metrics(tmp_path / "run")[0]["loss"] == pytest.approx(losses.mean().item(), rel=1e-5)


def test_dpo_is_refused_before_launch_where_it_cannot_run(tiny_qwen3, tiny_qwen2_5_vl, tmp_path):
    from spindle.api import make_trainer

    data = pairs_file(tmp_path, PAIRS)

    def job(model, **values):
        return load_job_config(None, lm_overrides(model, data, tmp_path / "run", **dpo_overrides(4, **values)))

    with pytest.raises(ConfigError, match="not the trained family"):
        make_trainer(job(tiny_qwen3, dpo__reference_model=tiny_qwen2_5_vl))


@pytest.mark.slow
@pytest.mark.parametrize("precompute", [False, True])
def test_fsdp2_on_two_processes_equals_one_process(precompute, tiny_qwen3, reference_qwen3, tmp_path):
    """dp_shard=2 (real gloo processes, each rank its half of the pairs) gives one process's losses and grad
    norms (1e-5 relative) over 3 steps: the pair is the unit the trainer normalises by over ranks. With
    dpo.precompute_reference the two ranks compute half the reference table each and gather it."""
    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(
        4, train__micro_batch_size=2, train__max_steps=3, dpo__reference_model=reference_qwen3, train__adam_eps=1e-4
    )
    values["checkpoint__export"] = False
    lm_train(tiny_qwen3, data, tmp_path / "one", **values)
    lm_train_cli(
        tiny_qwen3, data, tmp_path / "two", 2, parallel__dp_shard=2, dpo__precompute_reference=precompute, **values
    )
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["margin"] == pytest.approx(a["margin"], rel=1e-4, abs=1e-7)


@pytest.mark.slow
def test_sequence_parallel_equals_one_process(tiny_qwen3, reference_qwen3, tmp_path):
    """sp=2 (Ulysses: each rank half of every row's tokens) gives one process's losses, grad norms and margins
    over 3 steps (1e-5; the margins, differences of log-probability sums, 1e-6 absolute): each pair's
    log-probability sums the two ranks' chunks (differentiably, so each rank's gradient is its chunk's share),
    the reference's too."""
    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(4, train__max_steps=3, dpo__reference_model=reference_qwen3, train__adam_eps=1e-4)
    values["checkpoint__export"] = False
    lm_train(tiny_qwen3, data, tmp_path / "one", **values)
    lm_train_cli(tiny_qwen3, data, tmp_path / "two", 2, parallel__sp=2, **values)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        for key in ("margin", "rewards/chosen"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key


def test_a_killed_dpo_run_resumes_exactly(tiny_qwen3, tmp_path):
    """`spindle train` (DPO, the frozen starting weights as reference, shuffled pairs) SIGKILLed as step 4 begins,
    then `checkpoint.resume: auto` from the step-3 checkpoint: steps 1-6 logged, the losses and grad norms equal
    the uninterrupted run's exactly (CPU fp32, the same pairs in the same steps)."""
    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(
        2, data__shuffle=True, train__max_steps=6, train__lr=1e-2, checkpoint__every_steps=3, checkpoint__export=False
    )
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    lm_train(tiny_qwen3, data, whole, **values)
    spindle_train_killed(killed, lm_overrides(tiny_qwen3, data, killed, **values), at_step=4)
    lm_train(tiny_qwen3, data, killed, **{**values, "checkpoint__resume": "auto"})
    got, want = read_metrics(killed), read_metrics(whole)
    assert [m["step"] for m in got] == list(range(1, 7))
    for key in ("loss", "grad_norm", "margin"):
        assert [m[key] for m in got] == [m[key] for m in want], key


def test_a_precomputed_reference_equals_running_it_each_step(tiny_qwen3, reference_qwen3, tmp_path):
    """dpo.precompute_reference with dpo.reference_model: the reference's log-probabilities of every pair are
    computed once, cached in the run folder, and the copy is freed; the steps equal a run that runs the reference
    each step (1e-5). A cache made from other data is refused before any model loads, naming the data."""
    from spindle.data.reference_cache import FILE

    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(
        4, train__micro_batch_size=2, train__max_steps=3, dpo__reference_model=reference_qwen3,
        checkpoint__export=False, data__shuffle=True,
    )  # fmt: skip
    lm_train(tiny_qwen3, data, tmp_path / "each", **values)
    lm_train(tiny_qwen3, data, tmp_path / "once", **values, dpo__precompute_reference=True)
    cache = tmp_path / "once" / FILE
    from safetensors.torch import load_file

    assert load_file(cache)["logps"].shape == (len(PAIRS), 2)
    for a, b in zip(read_metrics(tmp_path / "each"), read_metrics(tmp_path / "once"), strict=True):
        for key in ("loss", "grad_norm", "margin", "rewards/chosen"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    pairs_file(tmp_path, [*PAIRS, {"prompt": "Up is", "chosen": " up", "rejected": " down"}])
    with pytest.raises(ConfigError, match=r"computed for another data\.path \(the preference pairs' content\)"):
        lm_train(
            tiny_qwen3, data, tmp_path / "once", **values, dpo__precompute_reference=True, checkpoint__resume="auto"
        )


def test_a_killed_run_with_a_precomputed_reference_resumes_against_the_starting_weights(tiny_qwen3, tmp_path):
    """A full fine-tune with dpo.precompute_reference and the default reference (the starting weights, no frozen
    copy held) SIGKILLed as step 3 begins resumes from the cache, not from the trained weights it restores: its
    steps equal (1e-5) a run that holds the frozen copy and runs it each step."""
    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(
        2, data__shuffle=True, train__max_steps=4, train__lr=1e-2, checkpoint__every_steps=2, checkpoint__export=False
    )
    lm_train(tiny_qwen3, data, tmp_path / "each", **values)
    killed = tmp_path / "killed"
    once = {**values, "dpo__precompute_reference": True}
    spindle_train_killed(killed, lm_overrides(tiny_qwen3, data, killed, **once), at_step=3)
    lm_train(tiny_qwen3, data, killed, **{**once, "checkpoint__resume": "auto"})
    got, want = read_metrics(killed), read_metrics(tmp_path / "each")
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    for a, b in zip(want, got, strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key
        # a difference of summed log-probabilities near 0, the reference's from the cache (computed in other batches)
        # against the live copy's: 1.9e-7 apart seen on an AVX-512 CPU, as in the expert-parallel test below
        assert b["margin"] == pytest.approx(a["margin"], rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_a_mixture_of_experts_under_expert_parallel_equals_one_process(tiny_checkpoint, tmp_path):
    """qwen3_moe (the router aux loss added to the DPO loss as the model defines it, the frozen starting weights as
    reference) with parallel.ep=2 over dp_shard=2: one process's losses, grad norms and margins over 3 steps."""
    model = tiny_checkpoint("qwen3_moe")
    data = pairs_file(tmp_path, PAIRS)
    values = dpo_overrides(4, train__micro_batch_size=2, train__max_steps=3, checkpoint__export=False)
    lm_train(model, data, tmp_path / "one", **values)
    lm_train_cli(model, data, tmp_path / "ep2", 2, parallel__dp_shard=2, parallel__ep=2, **values)
    for a, b in zip(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "ep2"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["margin"] == pytest.approx(a["margin"], rel=1e-5, abs=1e-6)  # a difference of sums near 0
