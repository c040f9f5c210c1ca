"""Start-up time and peak memory of a DiT dataset given as a large JSONL manifest: the lazy shard index
(`spindle.data.index`) against the in-memory list of samples (`read_manifest`).

Generates a manifest of `--lines` lines (default 1,000,000) twice: as one .jsonl file and as `--shards`
shard files in a folder tree. Each line names a clip and declares its size (width, height, frames), with
a mix of aspect ratios and lengths; the media files themselves are not needed: the datasets are listed
without the up-front decode check (which a run makes only for datasets up to CHECK_LIMIT samples).
Every variant runs in a fresh process (peak RSS is a high-water mark since the process started):

  in_memory        read_manifest(one file): a Python Sample per line (the reading before the index)
  index_build      build_dataset(shards) with an empty index cache: every line read and checked once
  index_cached     the same again: the cached index (what a resumed or repeated run does)
  buckets_cached   build_dit_data with data.buckets (Wan's grid) from the cached index: bucket
                   assignment from the declared sizes + the first epoch's plan
  read_1000        after index_cached: 1000 random samples read (one rank's reads are seeks)

Columns: seconds, peak RSS, and the peak over the interpreter with its imports (the data's own cost).

  python bench/data_index.py --json bench-data-index.json
  python bench/data_index.py --lines 100000 --shards 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import _common as common  # noqa: E402

# the listing alone: the media is neither decoded nor stat'ed (the generated paths do not exist)
LISTING_ONLY = {"check": False, "skip_bad_samples": True}
VARIANTS = ("in_memory", "index_build", "index_cached", "buckets_cached", "read_1000")
# (height, width, frames) of the generated lines: landscape, portrait and square clips, stills
SIZES = ((480, 832, 81), (832, 480, 81), (624, 624, 49), (480, 832, 33), (720, 1280, 1), (1024, 1024, 1))


def generate(folder: Path, lines: int, shards: int) -> None:
    """`folder/all.jsonl` and `folder/shards/<k // 4>/part-<k>.jsonl`: the same lines."""
    (folder / "shards").mkdir(parents=True, exist_ok=True)
    per_shard = -(-lines // shards)
    with (folder / "all.jsonl").open("w") as whole:
        for k in range(shards):
            part = folder / "shards" / f"{k // 4:03d}" / f"part-{k:05d}.jsonl"
            part.parent.mkdir(exist_ok=True)
            with part.open("w") as f:
                for i in range(k * per_shard, min(lines, (k + 1) * per_shard)):
                    height, width, frames = SIZES[i % len(SIZES)]
                    ext = "png" if frames == 1 else "mp4"
                    line = json.dumps(
                        {
                            "path": f"media/{i // 1000:04d}/{i:08d}.{ext}",
                            "caption": f"clip {i}: a scene with a moving subject, shot {i % 7}",
                            "width": width,
                            "height": height,
                            "frames": frames,
                        }
                    )
                    f.write(line + "\n")
                    whole.write(line + "\n")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(variant: str, folder: Path) -> dict:
    import numpy as np

    from spindle.config import MediaDataConfig
    from spindle.contracts.condition import PixelGrid
    from spindle.data.datasets import build_dataset, read_manifest
    from spindle.data.dit_data import build_dit_data

    base = peak_mb()
    start = time.perf_counter()
    shards = folder / "shards"
    if variant == "in_memory":
        count = len(read_manifest(folder / "all.jsonl"))
    elif variant in ("index_build", "index_cached"):
        count = len(build_dataset(shards, (480, 832), 81, **LISTING_ONLY))
    elif variant == "buckets_cached":
        cfg = MediaDataConfig(
            path=str(shards), buckets=True, resolution=(480, 832), num_frames=81, skip_bad_samples=True
        )
        built = build_dit_data(cfg, lambda: PixelGrid(16, 16, 4), seed=0, global_batch_size=64, check=False)
        count = len(built.dataset)
        assert built.order is not None
        steps = len(built.order.global_batches(0, 64))
    else:
        dataset = build_dataset(shards, (480, 832), 81, **LISTING_ONLY)
        count = len(dataset)
        start = time.perf_counter()  # the reads alone
        for i in np.random.default_rng(0).choice(count, 1000, replace=False):
            dataset.samples[int(i)]
    row = {
        "variant": variant,
        "samples": count,
        "seconds": time.perf_counter() - start,
        "peak_rss_mb": peak_mb(),
        "over_imports_mb": peak_mb() - base,
    }
    if variant == "buckets_cached":
        row["steps_per_epoch"] = steps
    return row


def run(variant: str, folder: Path, cache: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--data", str(folder)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPINDLE_CACHE_DIR": str(cache)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, Path(args.data))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        generate(folder, args.lines, args.shards)
        print(f"generated {args.lines:,} lines in {args.shards} shards ({time.perf_counter() - start:.1f} s)")
        size_mb = (folder / "all.jsonl").stat().st_size / 2**20
        rows = [run(v, folder, folder / "cache") for v in VARIANTS]
    columns: list[common.Column] = [
        ("variant", "variant", "<16", ""),
        ("samples", "samples", ">10", ","),
        ("seconds", "seconds", ">9", ".2f"),
        ("peak RSS MB", "peak_rss_mb", ">12", ".0f"),
        ("over imports MB", "over_imports_mb", ">16", ".0f"),
    ]
    print(f"{args.lines:,} lines ({size_mb:.0f} MB of JSONL), {args.shards} shards, {common.describe_device()}")
    common.print_table(columns, rows)
    if args.json:
        report = {"lines": args.lines, "shards": args.shards, "manifest_mb": size_mb, "rows": rows}
        common.write_report({**report, "device": common.describe_device()}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
