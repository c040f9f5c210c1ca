"""OpenAI-compatible HTTP serving (`spindle serve`): FastAPI app, job store, worker, rank fan-out.

`build_server(generator, ...)` wires a loaded `DiffusionGenerator` into an app; `spindle serve`
(spindle/commands/serve.py) loads the model, warms up and runs it under uvicorn.
"""

from __future__ import annotations

from typing import Any

from spindle.serve.jobs import Job, JobStore
from spindle.serve.worker import Engine, RankFanout, Worker

__all__ = ["Engine", "Job", "JobStore", "RankFanout", "Worker", "build_app"]


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
    cancel_wait: float = 10.0,
) -> Any:
    """A FastAPI app over a loaded generator (the worker thread starts with the app's lifespan).
    `app.state.serve` holds the engine, store and worker."""
    from spindle.serve.app import create_app

    engine = Engine(generator, model_id=model_id, root=root)
    store = JobStore(max_queue=max_queue, result_ttl=result_ttl)
    worker = Worker(engine, store, fanout=fanout, keep_frames=keep_frames)
    return create_app(engine, store, worker, shutdown_grace=shutdown_grace, cancel_wait=cancel_wait)
