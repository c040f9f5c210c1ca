"""Throughput and latency of `spindle serve` under N concurrent clients, on loopback.

Starts a live server (`python -m spindle serve`, a separate process; the tiny Wan checkpoint unless
--model is given) or uses a running one (--url), then N client threads (httpx) send requests until
--requests have been sent or --time-limit seconds have passed. Video models: POST /v1/videos, poll
GET /v1/videos/{id}, download the mp4; image models: POST /v1/images/generations. A request's
latency is from its POST to its result in hand (queueing included). A 429 is counted and retried
after its Retry-After. Prints a table and writes JSON (--json).

  python bench/serve.py --clients 4 --requests 24 --json bench/results/serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, port: int, args: argparse.Namespace, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "spindle",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-queue",
        str(args.max_queue or max(16, 2 * args.clients)),
        "--warmup-size",
        args.size,
        "--log-level",
        "warning",
        *args.server_args,
    ]
    if args.device:
        cmd += ["--device", args.device]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen | None, log_path: Path | None, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("server not ready in time")


class Bench:
    def __init__(self, url: str, media: str, args: argparse.Namespace):
        self.url = url
        self.media = media
        self.args = args
        self.lock = threading.Lock()
        self.sent = 0
        self.latencies: list[float] = []
        self.server_timings: list[dict[str, float]] = []
        self.failed: list[str] = []
        self.rejected = 0
        self.deadline = 0.0

    def take(self) -> int | None:
        with self.lock:
            if self.sent >= self.args.requests or time.monotonic() >= self.deadline:
                return None
            self.sent += 1
            return self.sent - 1

    def body(self, i: int) -> dict:
        a = self.args
        body = {
            "prompt": f"benchmark request {i}: a lighthouse in a storm",
            "size": a.size,
            "num_inference_steps": a.steps,
            "seed": i,
        }
        if a.guidance is not None:
            body["guidance_scale"] = a.guidance
        if self.media == "video":
            body["num_frames"] = a.num_frames
        else:
            body["response_format"] = "b64_json"
        return body

    def one(self, client: httpx.Client, i: int) -> None:
        start = time.perf_counter()
        while True:
            path = "/v1/videos" if self.media == "video" else "/v1/images/generations"
            r = client.post(path, json=self.body(i))
            if r.status_code == 429:
                with self.lock:
                    self.rejected += 1
                time.sleep(float(r.headers.get("Retry-After", "1")))
                continue
            break
        if r.status_code != 200:
            self.failed.append(f"{r.status_code} {r.text[:200]}")
            return
        timings = r.json().get("timings", {})
        if self.media == "video":
            job_id = r.json()["id"]
            while True:
                job = client.get(f"/v1/videos/{job_id}").json()
                if job["status"] in ("completed", "failed", "cancelled"):
                    break
                time.sleep(self.args.poll)
            if job["status"] != "completed":
                self.failed.append(f"{job_id} {job['status']}: {job.get('error')}")
                return
            content = client.get(f"/v1/videos/{job_id}/content")
            if content.status_code != 200 or not content.content:
                self.failed.append(f"{job_id} content {content.status_code}")
                return
            timings = job.get("timings", {})
        latency = time.perf_counter() - start
        with self.lock:
            self.latencies.append(latency)
            self.server_timings.append(timings)

    def client_loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as client:
            while (i := self.take()) is not None:
                self.one(client, i)

    def run(self) -> float:
        self.deadline = time.monotonic() + self.args.time_limit
        threads = [threading.Thread(target=self.client_loop) for _ in range(self.args.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="diffusers folder to serve (default: a tiny random Wan)")
    p.add_argument("--url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--requests", type=int, default=24, help="requests in all (bounded)")
    p.add_argument("--time-limit", type=float, default=300.0, help="stop sending after this many seconds")
    p.add_argument("--size", default="32x32", help="WxH of every request")
    p.add_argument("--num-frames", type=int, default=5, help="frames per video request")
    p.add_argument("--steps", type=int, default=2, help="denoising steps per request")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (model default if omitted)")
    p.add_argument("--max-queue", type=int, default=None, help="server --max-queue (default max(16, 2 x clients))")
    p.add_argument("--device", default=None, help="server --device")
    p.add_argument("--poll", type=float, default=0.02, help="status poll interval (s)")
    p.add_argument(
        "--server-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `spindle serve` options (last on the line), e.g. --server-args --nproc 2 --cfg-parallel",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.requests < 1:
        p.error("--clients and --requests must be >= 1")

    proc = None
    with tempfile.TemporaryDirectory(prefix="spindle-bench-serve-") as tmp:
        log_path = Path(tmp) / "server.log"
        model = args.model
        if args.url is None:
            if model is None:
                from spindle.models.wan.tiny import build_tiny as build_tiny_wan

                model = build_tiny_wan(Path(tmp) / "wan", seed=0)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            t0 = time.perf_counter()
            proc = start_server(Path(model), port, args, log_path)
        else:
            url = args.url.rstrip("/")
            t0 = time.perf_counter()
        try:
            health = wait_ready(url, proc, log_path)
            startup = time.perf_counter() - t0
            bench = Bench(url, health["media"], args)
            wall = bench.run()
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(120)
                if rc != 0:
                    print(f"warning: server exited {rc}:\n{log_path.read_text()[-2000:]}", file=sys.stderr)

    lat = np.array(bench.latencies) if bench.latencies else np.array([float("nan")])
    stages = sorted({k for t in bench.server_timings for k in t})
    result = {
        "model": str(model) if model else None,
        "url": args.url,
        "media": health["media"],
        "clients": args.clients,
        "requests_sent": bench.sent,
        "completed": len(bench.latencies),
        "failed": len(bench.failed),
        "rejected_429": bench.rejected,
        "wall_s": wall,
        "requests_per_s": len(bench.latencies) / wall if wall > 0 else 0.0,
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p95_s": float(np.percentile(lat, 95)),
        "latency_mean_s": float(lat.mean()),
        "latency_max_s": float(lat.max()),
        "startup_s": startup,
        "server_stage_mean_s": {k: float(np.mean([t.get(k, 0.0) for t in bench.server_timings])) for k in stages},
        "request": {
            "size": args.size,
            "num_frames": args.num_frames if health["media"] == "video" else None,
            "steps": args.steps,
            "guidance": args.guidance,
        },
        "server_args": args.server_args,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "failures": bench.failed[:10],
    }
    print(
        f"spindle serve on loopback: {result['media']} {args.size}"
        f"{' x ' + str(args.num_frames) + ' frames' if result['media'] == 'video' else ''}, {args.steps} steps, "
        f"{args.clients} clients, {bench.sent} requests (limit {args.requests} / {args.time_limit:g} s)"
    )
    print("| clients | completed | failed | 429 | wall s | req/s | p50 s | p95 s | mean s |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {args.clients} | {result['completed']} | {result['failed']} | {result['rejected_429']} | {wall:.2f} | "
        f"{result['requests_per_s']:.2f} | {result['latency_p50_s']:.3f} | {result['latency_p95_s']:.3f} | "
        f"{result['latency_mean_s']:.3f} |"
    )
    if stages:
        print(
            "server time per job (mean): "
            + ", ".join(f"{k} {v:.3f}s" for k, v in result["server_stage_mean_s"].items())
        )
    if bench.failed:
        print("failures: " + "; ".join(bench.failed[:5]), file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
