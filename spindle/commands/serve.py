"""Serve a diffusers checkpoint over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

  spindle serve --model PATH [--host 127.0.0.1 --port 30000]
  spindle serve --model PATH --nproc 2 --sp 2          # Ulysses SP over 2 processes
  spindle serve --model PATH --nproc 2 --cfg-parallel  # cond / uncond on different ranks

Loads the model once, warms up (one short generation), then serves:
GET /health, GET /v1/models, POST /v1/images/generations (image models), POST /v1/images/edits
(image-editing models: multipart image uploads), POST /v1/videos +
GET/DELETE /v1/videos/{id} + GET /v1/videos/{id}/content (video models), and with --lora-dir the
LoRA adapters a request chooses (`lora`, `lora_scale`): GET/POST /v1/loras, DELETE /v1/loras/{name}.
Jobs run one at a time, in order; --max-queue bounds the waiting ones (over it: 429 + Retry-After); finished results are
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
from typing import Any

from spindle.commands.engine_args import add_engine_arguments, check_family_parallel, check_world_size, engine_config
from spindle.commands.flags import add_section_arguments, section_from_args
from spindle.engine_config import (  # torch-free: `--help` stays light
    AdapterConfig,
    RequestLimits,
    ServeLimits,
    ServeSettings,
    check_adapter_engine,
)

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (images / videos)"

PIDFILE_ENV = "SPINDLE_SERVE_PIDFILE"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="diffusers pipeline folder (with model_index.json), or a Hugging Face repo id org/name[@revision] "
        "in the local cache",
    )
    add_section_arguments(p.add_argument_group("server (spindle.engine_config.ServeSettings)"), ServeSettings)
    g = p.add_argument_group(
        "limits (spindle.engine_config.RequestLimits / ServeLimits: per request / per connection; "
        "0 = no limit for the --max-* request bounds)"
    )
    add_section_arguments(g, RequestLimits)
    add_section_arguments(g, ServeLimits)
    add_section_arguments(
        p.add_argument_group("LoRA adapters chosen per request (spindle.engine_config.AdapterConfig)"), AdapterConfig
    )
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
    settings: ServeSettings = section_from_args(args, ServeSettings)
    limits = serve_limits(args)
    adapter_options: AdapterConfig = section_from_args(args, AdapterConfig)
    if adapter_options.lora_dir is not None:
        check_adapter_engine(engine, lambda name: "--" + name.replace("_", "-"))
    from spindle.hub import parse_repo_id, resolve_model_path

    given = args.model
    args.model = resolve_model_path(given, "--model")  # a Hugging Face repo id: its cached snapshot
    repo = parse_repo_id(given) if args.model != given else None
    if not (Path(args.model) / "model_index.json").is_file():
        raise FileNotFoundError(f"{args.model}/model_index.json not found: --model must be a diffusers pipeline folder")
    warmup_size = None
    if settings.warmup_size:
        from spindle.serve.errors import APIError
        from spindle.serve.params import parse_size

        try:
            warmup_size = parse_size(settings.warmup_size)
        except APIError as e:
            raise ValueError(f"--warmup-size: {e.message}") from None
    check_family_parallel(args)  # --sp / --ring against the family and its transformer, before a launch
    if not launched and args.nproc > 1:
        return _relaunch(args.nproc, args._argv)

    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and os.environ.get(PIDFILE_ENV):
        Path(os.environ[PIDFILE_ENV]).write_text(str(os.getpid()))
    logging.basicConfig(level=settings.log_level.upper(), format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    log = logging.getLogger("spindle.serve")

    from spindle.api import load_generator

    gen = load_generator(args.model, **dict(engine))
    fanout = None
    if world > 1:
        from spindle.serve.engine import RankFanout

        fanout = RankFanout()
    if adapter_options.lora_dir is not None:
        # the other ranks only mirror rank 0's loads and unloads (which evict): no bound of their own
        gen.enable_adapters(adapter_options.lora_dir, adapter_options.max_loras if rank == 0 else None)
    if fanout is not None:
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

    # default id: the folder's name, or a repo id's `org/name` (its snapshot folder is named by a commit)
    model_id = settings.served_model_name or (repo[0] if repo else Path(args.model).resolve().name)
    app = build_app(
        gen,
        model_id=model_id,
        root=str(Path(args.model).resolve()),
        max_queue=settings.max_queue,
        result_ttl=settings.result_ttl,
        keep_frames=settings.keep_frames,
        fanout=fanout,
        shutdown_grace=settings.shutdown_grace,
        shutdown_linger=settings.shutdown_linger,
        limits=limits,
    )
    state = app.state.serve
    try:
        if settings.warmup:
            warm_up(state, settings, warmup_size, log)
        server = make_server(app, host=settings.host, port=settings.port, log_level=settings.log_level)
        # uvicorn re-raises the signal that stopped it once it has shut down gracefully; with these
        # no-op handlers that re-raise does nothing and a clean stop exits 0.
        signal.signal(signal.SIGTERM, lambda s, f: None)
        signal.signal(signal.SIGINT, lambda s, f: None)
        server.run()
        if not getattr(server, "started", False):
            log.error("the server did not start (is %s:%d free?)", settings.host, settings.port)
            return 1
        return 0
    finally:
        state.worker.stop(settings.shutdown_grace)  # idempotent; releases the other ranks if serving never began
        _destroy()


WARMUP_FLAGS = "--warmup-size WxH / --warmup-frames N / --warmup-steps N, or --no-warmup to skip it"


def warm_up(state: Any, settings: ServeSettings, size: tuple[int, int] | None, log: logging.Logger) -> None:
    """The one generation before serving (`Engine.warmup_params`: generated conditioning images where the
    family needs them, the fewest steps its scheduler takes). Logged before it runs, so a slow one is never
    silent; a refusal or a failure is one error naming the warm-up and its flags."""
    from spindle.contracts.request import RequestError

    try:
        request = state.engine.warmup_params(size, settings.warmup_frames, settings.warmup_steps)
        params = request.params
    except RequestError as e:
        raise ValueError(f"the warm-up request was refused ({e}); set it with {WARMUP_FLAGS}") from None
    what = (
        f"{params.width}x{params.height}, {params.num_frames or 1} frame(s), {params.num_inference_steps} step(s)"
        + (f", {len(params.image)} generated conditioning image(s)" if params.image else "")
    )
    log.info("warm-up: one generation (%s) before serving; %s", what, WARMUP_FLAGS)
    try:
        seconds = state.worker.warmup(request)
    except (RequestError, RuntimeError) as e:
        raise ValueError(f"the warm-up generation ({what}) failed: {e}; change it with {WARMUP_FLAGS}") from e
    log.info("warm-up done in %.2f s", seconds)


def serve_limits(args: argparse.Namespace) -> ServeLimits:
    """The limit flags -> `ServeLimits` (a --max-* request bound of 0 means none); errors name the flag."""
    limits: ServeLimits = section_from_args(args, ServeLimits, request=section_from_args(args, RequestLimits))
    limits.check_file_limit()
    return limits


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
