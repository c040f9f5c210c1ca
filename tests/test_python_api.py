"""The documented Python API (issue 43, docs/python-api.md): `spindle.train(config, **overrides)` with a
mapping or a YAML file and the CLI's dotted keys, `spindle.load_generator`, both listed in `dir(spindle)`
and as quiet as the CLI (no library progress bars or warnings). Run in a fresh interpreter, as a user's
script is: the quiet settings are process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

SCRIPT = """
import sys, spindle
assert {"train", "load_generator", "DiffusionGenerator"} <= set(dir(spindle))
config = {"model": {"path": sys.argv[1]}, "data": {"path": sys.argv[2], "seq_len": 48},
          "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3}}
result = spindle.train(config, **{"train.output_dir": sys.argv[3]}, train__max_steps=2, checkpoint__export=False)
print("RESULT", result.last_step, result.output_dir)
again = spindle.train(sys.argv[3] + "/config.yaml", train__max_steps=3)  # the same run, resumed
print("AGAIN", again.last_step)
gen = spindle.load_generator(sys.argv[4], device="cpu")
out = gen.generate(prompt="a cat", height=32, width=32, num_frames=1, num_inference_steps=1, seed=0)
print("FRAMES", tuple(out.frames.shape))
"""


def test_train_and_load_generator_from_python_quietly(tiny_qwen3, lm_corpus, tiny_wan, tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, script, tiny_qwen3, lm_corpus, out, tiny_wan],
        capture_output=True,
        text=True,
        timeout=600,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RESULT 2 {out}" in proc.stdout and "AGAIN 3" in proc.stdout and "FRAMES (1, 1, 32, 32, 3)" in proc.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["lr"] == 1e-3 and saved["train"]["max_steps"] == 3
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # what the CLI hides: transformers' weight-loading and diffusers' component-loading bars, warnings
    for noise in ("Loading weights", "Loading pipeline components", "Warning", "it/s]"):
        assert noise not in proc.stderr, (noise, proc.stderr[-2000:])
    assert "resumed from step 2" in proc.stdout  # the run log is shown, as `spindle train` shows it
