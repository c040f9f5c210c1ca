"""OpenAI-compatible HTTP serving (`spindle serve`): the served model (`Engine`, with the rank
fan-out), the job store, the worker thread, and the FastAPI app assembled from one router per
resource (`routes/`).

`build_app(generator, ...)` wires a loaded `DiffusionGenerator` into an app; `spindle serve`
(spindle/commands/serve.py) loads the model, warms up and runs it under uvicorn.

The names below import lazily: `spindle serve --help` reads `spindle.serve.limits` (the limit
defaults) without importing the worker, and with it torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time __getattr__ imports on first use
    from spindle.serve.engine import Engine, RankFanout
    from spindle.serve.jobs import Job, JobStore
    from spindle.serve.limits import ServeLimits
    from spindle.serve.worker import Worker

_LAZY = {
    "Job": "spindle.serve.jobs",
    "JobStore": "spindle.serve.jobs",
    "ServeLimits": "spindle.serve.limits",
    "Engine": "spindle.serve.engine",
    "RankFanout": "spindle.serve.engine",
    "Worker": "spindle.serve.worker",
}

__all__ = ["Engine", "Job", "JobStore", "RankFanout", "ServeLimits", "Worker", "build_app"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'spindle.serve' has no attribute {name!r}")


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
    from spindle.serve.engine import Engine
    from spindle.serve.jobs import JobStore
    from spindle.serve.limits import ServeLimits
    from spindle.serve.worker import Worker

    limits = limits or ServeLimits()
    engine = Engine(generator, model_id=model_id, root=root, limits=limits.request, fanout=fanout)
    store = JobStore(max_queue=max_queue, result_ttl=result_ttl, max_results=limits.max_results)
    worker = Worker(engine, store, keep_frames=keep_frames)
    return create_app(
        engine,
        store,
        worker,
        limits=limits,
        shutdown_grace=shutdown_grace,
        shutdown_linger=shutdown_linger,
        cancel_wait=cancel_wait,
    )
