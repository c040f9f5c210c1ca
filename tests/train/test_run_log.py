"""What `spindle train` tells the user while it runs (issue 43, the smaller items): the summary names fp32
as fp32, every checkpoint and validation-sample write is logged with its path, and the run log's lines
(peak memory after step 1 among them) land on their own lines, never inside the step progress bar;
`train.validation=null` turns validation off like `train.lora=null` turns LoRA off."""

from __future__ import annotations

from spindle.api import load_job_config
from tests.conftest import run_spindle, train_overrides


def own_line(stream: str, text: str) -> bool:
    """`text` starts a line as the terminal shows it (after the bar's last carriage return)."""
    hits = [line.rsplit("\r", 1)[-1] for line in stream.split("\n") if text in line]
    return bool(hits) and all(h.startswith(text) for h in hits)


def test_the_run_log_names_writes_and_stays_out_of_the_progress_bar(tiny_wan, shapes_videos, tmp_path):
    out = tmp_path / "run"
    overrides = train_overrides(
        tiny_wan,
        shapes_videos,
        out,
        train__max_steps=2,
        train__global_batch_size=2,
        checkpoint__every_steps=1,
        checkpoint__export=False,
        train__validation='{every_steps: 2, prompts: ["a red circle"], num_inference_steps: 1}',
    )
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    proc = run_spindle("train", config, *overrides)
    assert proc.returncode == 0, proc.stderr
    assert "precision fp32" in proc.stdout and "precision no" not in proc.stdout
    err = proc.stderr
    for step in (1, 2):
        assert own_line(err, f"step {step}: checkpoint saved to {out / 'checkpoints' / f'step-00000{step}'}"), err
    assert own_line(err, f"step 2: 1 validation sample(s) written to {out / 'samples' / 'step-000002'}"), err
    assert own_line(err, "peak memory after step 1"), err


def test_validation_null_is_no_validation(tiny_wan, shapes_videos, tmp_path):
    cfg = load_job_config(None, [*train_overrides(tiny_wan, shapes_videos, tmp_path / "run"), "train.validation=null"])
    assert cfg.train.validation.every_steps == 0 and not cfg.train.validation.prompts
    assert (
        load_job_config(None, [*train_overrides(tiny_wan, shapes_videos, tmp_path), "train.lora=null"]).train.lora
        is None
    )
