"""Chunked linear cross-entropy vs full logits + F.cross_entropy: forward+backward time and peak memory.

Each row runs in a fresh process (so peak RSS is its own): `full` builds the [tokens, vocab] fp32
logits and calls F.cross_entropy (what transformers' ForCausalLMLoss does); `chunk=K` is
`spindle.ops.losses.linear_cross_entropy` with chunk_size K. Peak = max RSS during forward+backward
minus RSS with the inputs allocated. Prints a markdown table and optionally writes JSON.

  python bench/linear_ce.py --tokens 2048 --hidden 512 --vocab 32768 --json bench-linear-ce.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run_one(args) -> dict:
    import torch
    import torch.nn.functional as F

    from spindle.ops.losses import linear_cross_entropy

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    labels[::8] = -100

    def step():
        hidden.grad = weight.grad = None
        if args.method == "full":
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="mean")
        else:
            loss = linear_cross_entropy(hidden, weight, labels, reduction="mean", chunk_size=int(args.method))
        loss.backward()
        return loss.item()

    base = _rss_mb()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    return {"method": args.method, "seconds": statistics.median(times), "peak_mb": peak, "loss": loss}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--chunks", default="256,1024", help="comma-separated chunk sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--method", help=argparse.SUPPRESS)  # internal: one row in this process
    args = p.parse_args()
    if args.method:
        print(json.dumps(run_one(args)))
        return 0
    rows = []
    for method in ["full", *args.chunks.split(",")]:
        cmd = [sys.executable, __file__, "--method", method]
        for name in ("tokens", "hidden", "vocab", "repeats", "threads"):
            cmd += [f"--{name}", str(getattr(args, name))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    logits_mb = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab}: fp32 logits = {logits_mb:.0f} MB")
    print("| method | fwd+bwd s (median) | peak MB over inputs | loss |")
    print("|---|---|---|---|")
    for r in rows:
        name = "full logits + F.cross_entropy" if r["method"] == "full" else f"linear_cross_entropy chunk={r['method']}"
        print(f"| {name} | {r['seconds']:.3f} | {r['peak_mb']:.0f} | {r['loss']:.6f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
