"""A run folder is one run (issue 25.1): a resume with a key that defines the run changed is refused
before any work, naming the key (old and new values), unless checkpoint.resume=force; a run already at
max_steps is left untouched; a longer max_steps continues the original learning-rate schedule; every
resume says where it resumed from; the run summarises itself (start and end) in summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spindle.train.metrics import read_metrics
from tests.conftest import lm_overrides


@pytest.fixture
def finished_run(tiny_qwen3, lm_corpus, tmp_path, spindle_cli) -> tuple[Path, list[str]]:
    """A 2-step causal-LM run trained to its end through the CLI; -> (config file, its overrides)."""
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    overrides = lm_overrides(
        tiny_qwen3,
        lm_corpus,
        tmp_path / "run",
        train__max_steps=2,
        checkpoint__resume="auto",
        checkpoint__export=False,
    )
    first = spindle_cli("train", config, *overrides)
    assert first.returncode == 0, first.stderr
    return config, overrides


def test_a_finished_run_re_run_is_left_untouched(finished_run, tmp_path, spindle_cli):
    config, overrides = finished_run
    out = tmp_path / "run"
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}
    again = spindle_cli("train", config, *overrides)
    assert again.returncode == 0, again.stderr
    assert "run already complete: step 2 of train.max_steps=2" in again.stdout
    assert "checkpoints/step-000002" in again.stdout
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}
    assert after == before  # config.yaml, run.json, metrics, summary: not rewritten
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_another_data_path_in_the_same_folder_is_refused_naming_it(finished_run, tmp_path, lm_corpus, spindle_cli):
    config, overrides = finished_run
    out = tmp_path / "run"
    config_yaml = (out / "config.yaml").read_bytes()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "another dataset altogether"}) + "\n")
    refused = spindle_cli("train", config, *overrides, f"data.path={other}", "train.max_steps=4", "train.lr=0.002")
    assert refused.returncode == 2
    err = refused.stderr
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"data.path: '{lm_corpus.resolve()}' -> '{other.resolve()}'" in err
    assert "train.lr: 0.001 -> 0.002" in err
    assert "checkpoint.resume=force" in err and "train.output_dir" in err
    assert (out / "config.yaml").read_bytes() == config_yaml
    assert [m["step"] for m in read_metrics(out)] == [1, 2]

    forced = spindle_cli(
        "train", config, *overrides, f"data.path={other}", "train.max_steps=3", "checkpoint.resume=force"
    )
    assert forced.returncode == 0, forced.stderr
    assert f"resumed from step 2 (checkpoint {out / 'checkpoints' / 'step-000002'})" in forced.stdout
    assert json.loads((out / "run.json").read_text())["identity"]["data.path"] == str(other.resolve())
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


def test_longer_max_steps_continues_the_original_schedule(tiny_qwen3, lm_corpus, tmp_path):
    from spindle.api import load_job_config, train

    cosine = dict(train__lr_schedule="cosine", train__min_lr_ratio=0.1, checkpoint__export=False)
    out = tmp_path / "run"
    train(load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, out, train__max_steps=3, **cosine)))
    extended = lm_overrides(tiny_qwen3, lm_corpus, out, train__max_steps=5, checkpoint__resume="auto", **cosine)
    train(load_job_config(None, extended))
    lrs = [m["lr"] for m in read_metrics(out)]
    # the 3-step cosine down to its floor (0.1 of lr 1e-3), then the floor: no jump back up to a 5-step cosine
    assert lrs == pytest.approx([1e-3, 7.75e-4, 3.25e-4, 1e-4, 1e-4])
    assert json.loads((out / "run.json").read_text())["schedule_steps"] == 3


def test_the_run_summarises_itself(tiny_qwen3, lm_corpus, tmp_path, spindle_cli):
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    out = tmp_path / "run"
    done = spindle_cli("train", config, *lm_overrides(tiny_qwen3, lm_corpus, out, checkpoint__export=False))
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    start, end = summary["start"], summary["end"]
    assert (start["family"], start["task"], start["precision"]) == ("qwen3", "causal_lm", "no")
    data = start["data"]
    assert data["documents"] == 26 and data["rows"] > 0 and data["truncated"] >= 0
    assert start["epochs"] == pytest.approx(3 * 8 / data["rows"], abs=1e-3)
    assert start["parameters"]["trainable"] > 0 and start["parameters"]["frozen"] == 0
    # the estimate the shipped configs state (bench/config_memory.py): fp32 weights, grads, AdamW; one shard
    from spindle.train.memory import state_memory_per_rank

    assert start["state_memory"] == state_memory_per_rank(start["parameters"]["trainable"], 0, 1).__dict__
    assert start["mesh"] == {
        "world": 1,
        "dims": {"dp_replicate": 1, "dp_shard": 1, "sp": 1, "ring": 1, "ep": 1},
        "roles": {},
    }
    assert start["resume"] == {"step": 0, "checkpoint": None}
    assert start["outputs"]["folder"] == str(out)
    assert start["extra"] == {}
    losses = [m["loss"] for m in read_metrics(out)]
    assert (end["loss_first"], end["loss_last"], end["steps"]) == (losses[0], losses[-1], 3)
    assert end["seconds"] > 0 and end["samples_per_s"] > 0 and end["peak_memory"]["gib"] > 0
    assert f"data: documents {data['documents']}, rows {data['rows']}" in done.stdout
    assert "parameters:" in done.stdout and "done: 3 steps" in done.stdout
    assert "training state: " in done.stdout and "FSDP2 shards" in done.stdout


def test_with_nproc_the_refusal_comes_before_any_worker_starts(finished_run, tmp_path, spindle_cli):
    """`--nproc 2`: the launching process refuses (one line, exit 2) before torchrun would start."""
    config, overrides = finished_run
    refused = spindle_cli("train", config, *overrides, "train.seed=1", "--nproc", "2")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "train.seed: 0 -> 1" in refused.stderr


def test_resume_none_into_a_folder_holding_a_run_is_refused(finished_run, tmp_path, spindle_cli):
    """One run per folder whatever checkpoint.resume says (issue 43): `none` (start over) into a folder
    holding checkpoints is refused naming the keys that differ and the ways out; nothing is touched."""
    config, overrides = finished_run
    out = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for extra in ([], ["--nproc", "2"]):
        refused = spindle_cli("train", config, *overrides, "checkpoint.resume=none", "train.lr=0.002", *extra)
        assert refused.returncode == 2, refused.stderr
        err = refused.stderr
        assert err.count("\n") == 1 and "Traceback" not in err
        assert "newest step-000002" in err and "train.lr: 0.001 -> 0.002" in err
        assert "checkpoint.resume=force" in err and "fresh train.output_dir" in err and "resume=auto" in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


def test_by_default_a_rerun_resumes_the_same_run(finished_run, tmp_path, spindle_cli):
    """Without checkpoint.resume (default auto) a rerun with a longer max_steps continues the run."""
    config, overrides = finished_run
    out = tmp_path / "run"
    default = [o for o in overrides if not o.startswith("checkpoint.resume=")]
    again = spindle_cli("train", config, *default, "train.max_steps=3")
    assert again.returncode == 0, again.stderr
    assert f"resumed from step 2 (checkpoint {out / 'checkpoints' / 'step-000002'})" in again.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


def test_the_summary_says_what_each_mesh_dimension_does():
    from spindle.distributed.mesh import ParallelDims
    from spindle.train.run_summary import format_start, mesh_layout

    mesh = mesh_layout(ParallelDims(dp_replicate=2, dp_shard=2, ep=2).resolve(4))
    assert mesh["world"] == 4 and sorted(mesh["roles"]) == ["dp_replicate", "dp_shard", "ep"]
    start = dict(
        family="qwen3_moe",
        task="moe_causal_lm",
        max_steps=3,
        global_batch_size=8,
        precision="bf16",
        data={"rows": 4},
        epochs=6.0,
        parameters={"trainable": 10, "frozen": 5},
        mesh=mesh,
        resume={"step": 2, "checkpoint": "out/checkpoints/step-000002"},
        outputs={"folder": "out"},
        extra={"peak_memory_after_load_gib": 1.5},
    )
    text = format_start(start)
    assert "mesh: 4 processes: dp_replicate=2 (HSDP" in text and "ep=2 (expert parallel" in text
    assert "start: step 2 (checkpoint out/checkpoints/step-000002)" in text
    assert text.endswith("peak_memory_after_load_gib: 1.5")  # extra fields: one line each


def test_a_rerun_demo_replaces_its_own_earlier_run_and_nothing_else(tmp_path):
    """`spindle demo` twice into one --out trains from the start again (a training job would refuse to start over
    in a folder holding a run); a folder there that is not an earlier demo run is left alone and refused."""
    from spindle.commands.demo import fresh_run_folder
    from spindle.train.run_record import RUN_FILE

    earlier = tmp_path / "demo" / "run"
    (earlier / "checkpoints" / "step-000150").mkdir(parents=True)
    (earlier / RUN_FILE).write_text("{}")
    assert fresh_run_folder(earlier) == earlier and not earlier.exists()
    foreign = tmp_path / "mine" / "run"
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="is not an earlier demo's run; give another --out"):
        fresh_run_folder(foreign)
    assert (foreign / "notes.txt").read_text() == "keep"


def test_an_unset_data_packing_is_recorded_as_the_model_resolves_it(tiny_qwen3, tiny_checkpoint, lm_corpus, tmp_path):
    """`data.packing` unset (its default) is recorded resolved: true for a softmax-attention model, so a run recorded
    when the default was `true` resumes unchanged; false for a linear-attention one (Qwen3.5)."""
    from spindle.api import load_job_config
    from spindle.train.run_record import changed_keys, run_identity

    unset = run_identity(load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path / "a")))
    explicit = run_identity(
        load_job_config(None, lm_overrides(tiny_qwen3, lm_corpus, tmp_path / "a", data__packing=True))
    )
    assert unset["data.packing"] is True and changed_keys(explicit, unset) == []
    qwen3_5 = load_job_config(None, lm_overrides(tiny_checkpoint("qwen3_5"), lm_corpus, tmp_path / "b"))
    assert run_identity(qwen3_5)["data.packing"] is False
