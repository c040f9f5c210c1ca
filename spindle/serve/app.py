"""The FastAPI app: OpenAI-compatible image and video generation over one loaded model.

`create_app` only assembles: the shared state (`state.py`), the routers (`routes/`, one module
per resource), the error handlers (`errors.py`) and the lifespan that starts and stops the worker.

  GET  /health                  routes/health.py
  GET  /v1/models[/{id}]        routes/models.py
  POST /v1/images/generations   routes/images.py
  /v1/videos[/{id}[/content]]   routes/videos.py
  /v1/loras[/{name}]            routes/adapters.py (LoRA adapters loaded at run time, chosen per request)

Every 4xx/5xx body is OpenAI's `{"error": {"message", "type", "param", "code"}}`. Request bodies
are read by `bodies.py` (size cap, deadline, encodings), mapped onto the engine's params by
`params.py`, and every field is validated by the engine against the model and the server's limits
before a job is queued (`Engine.validate`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from spindle.serve.engine import Engine
from spindle.serve.errors import SafeJSONResponse, install_error_handlers
from spindle.serve.jobs import JobStore
from spindle.serve.limits import ServeLimits
from spindle.serve.routes import ROUTERS
from spindle.serve.state import ServeState, body_schema
from spindle.serve.worker import Worker

log = logging.getLogger("spindle.serve")


def create_app(
    engine: Engine,
    store: JobStore,
    worker: Worker,
    *,
    limits: ServeLimits | None = None,
    shutdown_grace: float = 30.0,
    shutdown_linger: float = 3.0,
    cancel_wait: float = 10.0,
) -> FastAPI:
    """The app over a loaded engine. The worker thread starts with the app (lifespan) and stops
    with it: no new jobs, waiting ones cancelled, the running one finished (or cancelled after
    `shutdown_grace` s). `state.drain()` is the same stop while still answering (SIGTERM)."""
    state = ServeState(engine, store, worker, limits or ServeLimits(), shutdown_grace, shutdown_linger, cancel_wait)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not worker.alive:
            worker.start()
        try:
            yield
        finally:
            state.shutting_down = True
            await asyncio.to_thread(worker.stop, shutdown_grace)
            log.info("worker stopped; %s", store.stats())

    app = FastAPI(title="Spindle", version="0.1.0", lifespan=lifespan, default_response_class=SafeJSONResponse)
    app.state.serve = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    document_bodies(app, state)
    return app


def document_bodies(app: FastAPI, state: ServeState) -> None:
    """A route that reads its own body (`state.reads_body`) gets it documented in the app's OpenAPI
    schema with the served family's request model (its options as fields). Done on the schema, not
    on the routes: the routers are module-level and shared by every app."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()  # (FastAPI keeps it as app.openapi_schema: patched once, served as patched)
        for router in ROUTERS:
            for route in router.routes:
                base = getattr(getattr(route, "endpoint", None), "body_model", None)
                if isinstance(route, APIRoute) and base is not None:
                    for method in route.methods or ():
                        schema["paths"][route.path][method.lower()].update(body_schema(state.request_model(base)))
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema
