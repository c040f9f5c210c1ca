"""Serve a diffusers checkpoint over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  spindle serve --model PATH [--host 127.0.0.1 --port 30000]
  spindle serve --model PATH --nproc 2 --sp 2          # Ulysses SP over 2 processes
  spindle serve --model PATH --nproc 2 --cfg-parallel  # cond / uncond on different ranks

Loads the model once, warms up (one short generation), then serves:
GET /health, GET /v1/models, POST /v1/images/generations (image models), POST /v1/images/edits
(image-editing models: multipart image uploads), POST /v1/videos +
GET/DELETE /v1/videos/{id} + GET /v1/videos/{id}/content (video models). Jobs run one at a time,
in order; --max-queue bounds the waiting ones (over it: 429 + Retry-After); finished results are
kept --result-ttl seconds, at most --max-results of them (the oldest finished go first). Limits
(--max-pixels/-frames/-steps/-prompt-chars/-outputs/-body-bytes, --request-timeout,
--keep-alive-timeout, --max-connections) bound what one request or connection may take; /health
and /v1/models report them. SIGTERM / Ctrl-C: new work gets 503 while job status
stays readable, waiting jobs are cancelled, the running one may finish (--shutdown-grace seconds,
then it is cancelled), pollers get --shutdown-linger seconds to read final statuses, exit 0.
See docs/serving.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from spindle.commands.engine_args import add_engine_arguments, check_world_size, engine_config
from spindle.commands.flags import add_section_arguments, section_from_args
from spindle.engine_config import RequestLimits, ServeLimits  # torch-free: `--help` stays light

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (images / videos)"

PIDFILE_ENV = "SPINDLE_SERVE_PIDFILE"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="diffusers pipeline folder (with model_index.json)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default 30000)")
    p.add_argument("--served-model-name", default=None, help="model id in /v1/models (default: the folder name)")
    p.add_argument("--max-queue", type=int, default=16, help="jobs that may wait; one more gets 429 (default 16)")
    p.add_argument(
        "--result-ttl",
        type=float,
        default=3600.0,
        help="seconds a finished job's result is kept (then 410; default 3600)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds the running job may take to finish before it is cancelled",
    )
    p.add_argument(
        "--shutdown-linger",
        type=float,
        default=3.0,
        help="on SIGTERM, seconds job status stays readable after the last job ended (default 3)",
    )
    g = p.add_argument_group(
        "limits (spindle.engine_config.RequestLimits / ServeLimits: per request / per connection; "
        "0 = no limit for the --max-* request bounds)"
    )
    add_section_arguments(g, RequestLimits)
    add_section_arguments(g, ServeLimits)
    p.add_argument(
        "--keep-frames",
        action="store_true",
        help="also keep each result's float32 frames (GET .../content?variant=npy; memory heavy)",
    )
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up generation")
    p.add_argument("--warmup-size", default=None, help="warm-up size WxH (default: the model's default size)")
    p.add_argument("--warmup-frames", type=int, default=1, help="warm-up frame count for video models (default 1)")
    p.add_argument("--warmup-steps", type=int, default=1, help="warm-up denoising steps (default 1)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # engine options: as `spindle generate`
    add_engine_arguments(p)


def _relaunch(nproc: int, argv: list[str]) -> int:
    """Run this command as `nproc` processes under torchrun, in their own session so that a
    terminal's Ctrl-C reaches only us; SIGTERM/SIGINT are forwarded to rank 0 (it shuts the
    server down gracefully and releases the other ranks), so a clean stop exits 0."""
    from spindle.distributed.launch import torchrun_command

    with tempfile.TemporaryDirectory(prefix="spindle-serve-") as tmp:
        pidfile = Path(tmp) / "rank0.pid"
        env = {**os.environ, PIDFILE_ENV: str(pidfile)}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
        proc = subprocess.Popen(torchrun_command(nproc, argv), env=env, start_new_session=True)

        def forward(signum, frame):
            try:
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):  # rank 0 not up yet: stop the launcher itself
                proc.send_signal(signal.SIGTERM)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        return proc.wait()


def run(args: argparse.Namespace) -> int:
    engine = engine_config(args)  # bad engine flags fail here, before a launch or a load
    world, launched = check_world_size(args)
    for name in ("max_queue", "warmup_frames", "warmup_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.result_ttl <= 0:
        raise ValueError(f"--result-ttl must be > 0 seconds; got {args.result_ttl}")
    limits = serve_limits(args)
    if not (Path(args.model) / "model_index.json").is_file():
        raise FileNotFoundError(f"{args.model}/model_index.json not found: --model must be a diffusers pipeline folder")
    warmup_size = None
    if args.warmup_size:
        from spindle.serve.errors import APIError
        from spindle.serve.params import parse_size

        try:
            warmup_size = parse_size(args.warmup_size)
        except APIError as e:
            raise ValueError(f"--warmup-size: {e.message}") from None
    if not launched and args.nproc > 1:
        return _relaunch(args.nproc, args._argv)

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and os.environ.get(PIDFILE_ENV):
        Path(os.environ[PIDFILE_ENV]).write_text(str(os.getpid()))
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    log = logging.getLogger("spindle.serve")

    from spindle.api import load_generator

    gen = load_generator(args.model, **dict(engine))
    fanout = None
    if world > 1:
        from spindle.serve.engine import RankFanout

        fanout = RankFanout()
        if fanout.rank != 0:
            # rank 0 decides when to stop (and tells us); a launcher's signal must not kill us mid-collective
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            ran = fanout.follow(gen)
            log.info("rank %d: stopped after %d jobs", fanout.rank, ran)
            _destroy()
            return 0

    from spindle.serve import build_app
    from spindle.serve.server import make_server

    model_id = args.served_model_name or Path(args.model).resolve().name
    app = build_app(
        gen,
        model_id=model_id,
        root=str(Path(args.model).resolve()),
        max_queue=args.max_queue,
        result_ttl=args.result_ttl,
        keep_frames=args.keep_frames,
        fanout=fanout,
        shutdown_grace=args.shutdown_grace,
        shutdown_linger=args.shutdown_linger,
        limits=limits,
    )
    state = app.state.serve
    try:
        if args.warmup:
            params = state.engine.warmup_params(warmup_size, args.warmup_frames, args.warmup_steps)
            seconds = state.worker.warmup(params)
            log.info(
                "warm-up (%sx%s, %s frames, %d steps): %.2f s",
                params.width,
                params.height,
                params.num_frames,
                params.num_inference_steps,
                seconds,
            )
        server = make_server(app, host=args.host, port=args.port, log_level=args.log_level)
        # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
        # no-op handlers that re-raise does nothing and a clean stop exits 0.
        signal.signal(signal.SIGTERM, lambda s, f: None)
        signal.signal(signal.SIGINT, lambda s, f: None)
        server.run()
        if not getattr(server, "started", False):
            log.error("the server did not start (is %s:%d free?)", args.host, args.port)
            return 1
        return 0
    finally:
        state.worker.stop(args.shutdown_grace)  # idempotent; releases the other ranks if serving never began
        _destroy()


def serve_limits(args: argparse.Namespace) -> ServeLimits:
    """The limit flags -> `ServeLimits` (a --max-* request bound of 0 means none); errors name the flag."""
    if args.shutdown_linger < 0:
        raise ValueError(f"--shutdown-linger must be >= 0 seconds; got {args.shutdown_linger}")
    limits: ServeLimits = section_from_args(args, ServeLimits, request=section_from_args(args, RequestLimits))
    limits.check_file_limit()
    return limits


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
