"""Peak memory of DiT training on raw media vs on a `spindle precompute` cache (CPU).

  python bench/precompute.py [--out /tmp/spindle-bench-precompute]

A tiny Wan whose text encoder is made large (UMT5 d_model 1024, 12 layers: 0.16B parameters, the
part a real run keeps off the GPU with the cache) trains 2 steps each way in a fresh process; the
table reports the peak RSS of each process (ru_maxrss) and the condition model's resident
parameter bytes, then checks the two runs' losses agree.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys
from spindle.api import load_job_config
from spindle.api import make_trainer
cfg = load_job_config(None, json.loads(sys.argv[1]))
trainer = make_trainer(cfg)
pipe = trainer.task.condition.pipe
cond_bytes = sum(
    p.numel() * p.element_size()
    for m in pipe.components.values() if hasattr(m, "parameters")
    for p in m.parameters() if not p.is_meta
)
trainer.run()
print(json.dumps({"cond_bytes": cond_bytes, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/spindle-bench-precompute")
    args = ap.parse_args()
    out = Path(args.out)
    from spindle.data.synthetic import make_shapes_video_dataset
    from spindle.models.wan.tiny import build_tiny as build_tiny_wan

    model = out / "wan"
    if not (model / "model_index.json").is_file():
        build_tiny_wan(model, seed=0, text_encoder=dict(d_model=1024, d_ff=4096, num_layers=12, num_heads=16))
    data = out / "data"
    if not data.is_dir():
        make_shapes_video_dataset(data, num_videos=4, num_frames=9, size=(32, 32))
    base = [
        f"model.path={model}", "model.max_text_length=16", f"data.path={data}", "data.resolution=[32,32]",
        "data.num_frames=9", "train.max_steps=2", "train.global_batch_size=2", "train.micro_batch_size=2",
        "checkpoint.export=false", "train.tensorboard=false",
    ]  # fmt: skip
    cache = out / "cache"
    cfg_file = out / "cfg.yaml"
    cfg_file.write_text("{}\n")
    subprocess.run(
        [sys.executable, "-m", "spindle", "precompute", str(cfg_file), *base, "--out", str(cache)], check=True
    )
    rows = {}
    for name, extra in (("raw media", []), ("precomputed", [f"data.precomputed={cache}"])):
        run_dir = out / name.replace(" ", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        overrides = [*base, f"train.output_dir={run_dir}", *extra]
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(overrides)], capture_output=True, text=True, check=True
        )
        rows[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        rows[name]["losses"] = [
            json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
    print("| run | condition model resident params | peak RSS | losses |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        losses = ", ".join(f"{x:.6f}" for x in r["losses"])
        print(f"| {name} | {r['cond_bytes'] / 2**20:.1f} MiB | {r['peak_rss_kb'] / 1024:.0f} MiB | {losses} |")


if __name__ == "__main__":
    main()
