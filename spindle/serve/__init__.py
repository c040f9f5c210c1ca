"""OpenAI-compatible HTTP serving (`spindle serve`): FastAPI app, job store, worker, rank fan-out.

`build_server(generator, ...)` wires a loaded `DiffusionGenerator` into an app; `spindle serve`
(spindle/commands/serve.py) loads the model, warms up and runs it under uvicorn.
"""

from __future__ import annotations

from typing import Any

from spindle.serve.jobs import Job, JobStore
from spindle.serve.limits import ServeLimits
from spindle.serve.worker import Engine, RankFanout, Worker

__all__ = ["Engine", "Job", "JobStore", "RankFanout", "ServeLimits", "Worker", "build_app"]


def build_app(
    generator: Any,
    *,
    model_id: str,
    root: str | None = None,
    max_queue: int = 16,
    result_ttl: float = 3600.0,
    keep_frames: bool = False,
    fanout: RankFanout | None = None,
    shutdown_grace: float = 30.0,
    shutdown_linger: float = 3.0,
    cancel_wait: float = 10.0,
    limits: ServeLimits | None = None,
) -> Any:
    """A FastAPI app over a loaded generator (the worker thread starts with the app's lifespan).
    `app.state.serve` holds the engine, store, worker and limits. Serve it with
    `spindle.serve.server.make_server(app, ...)` (connection limits, draining SIGTERM)."""
    from spindle.serve.app import create_app

    limits = limits or ServeLimits()
    engine = Engine(generator, model_id=model_id, root=root, limits=limits.request)
    store = JobStore(max_queue=max_queue, result_ttl=result_ttl)
    worker = Worker(engine, store, fanout=fanout, keep_frames=keep_frames)
    return create_app(
        engine,
        store,
        worker,
        limits=limits,
        shutdown_grace=shutdown_grace,
        shutdown_linger=shutdown_linger,
        cancel_wait=cancel_wait,
    )
