"""What every route shares: `ServeState` (the engine, the job store, the worker, the limits and the
shutdown settings), reached by a route through the `State` dependency (`app.state.serve`), and
reading a request body bounded and validated against the served family's request model."""

from __future__ import annotations

import asyncio
import difflib
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from spindle.contracts.request import RequestError
from spindle.contracts.sampling import BOUND_ERRORS
from spindle.infer.options import request_model
from spindle.serve.bodies import parse_fields, read_body
from spindle.serve.engine import Engine
from spindle.serve.errors import APIError, request_error
from spindle.serve.jobs import Job, JobStore, ShuttingDown
from spindle.serve.limits import ServeLimits
from spindle.serve.worker import Worker

log = logging.getLogger("spindle.serve")

M = TypeVar("M", bound=BaseModel)
F = TypeVar("F", bound=Callable[..., Any])


class ServeState:
    """What the routes share: the engine, the store, the worker and settings."""

    def __init__(
        self,
        engine: Engine,
        store: JobStore,
        worker: Worker,
        limits: ServeLimits,
        shutdown_grace: float,
        shutdown_linger: float,
        cancel_wait: float,
    ):
        self.engine = engine
        self.store = store
        self.worker = worker
        self.limits = limits
        self.shutdown_grace = shutdown_grace
        self.shutdown_linger = shutdown_linger
        self.cancel_wait = cancel_wait
        self.created = int(time.time())
        self.shutting_down = False
        self._request_models: dict[type[BaseModel], type[BaseModel]] = {}

    async def drain(self) -> None:
        """Graceful stop (SIGTERM): new work gets 503 at once while job status stays readable; the
        waiting jobs are cancelled, the running one gets `shutdown_grace` s to finish and is then
        cancelled (a waiting image request answers 503 JSON); then `shutdown_linger` s more so that
        pollers read the final statuses (none when the store holds no job), and the server may exit."""
        self.shutting_down = True
        log.info("shutting down: %s", self.store.stats())
        await asyncio.to_thread(self.worker.stop, self.shutdown_grace)
        stats = self.store.stats()
        if not stats["stored"]:  # no job whose status anyone could still poll: exit now
            log.info("worker stopped; %s", stats)
            return
        log.info("worker stopped; %s; answering status for %g s more", stats, self.shutdown_linger)
        await asyncio.sleep(self.shutdown_linger)

    def request_model(self, base: type[M]) -> type[M]:
        """`base` with the served family's declared options (e.g. `true_cfg_scale`) as fields."""
        if base not in self._request_models:
            self._request_models[base] = request_model(base, self.engine.schema)
        return self._request_models[base]  # type: ignore[return-value]  # (built from `base` above)

    async def read_request(self, request: Request, base: type[M], family_options: bool = True) -> M:
        """The request body, bounded and decoded (`bodies.py`), validated against `base` extended
        with the family's options (unless `family_options` is False: a body that is no generation).
        A JSON body is validated strictly (a number field refuses `true` and `"2"`); a form body
        leniently, since a form carries nothing but text."""
        if self.shutting_down:
            raise ShuttingDown(headers={"Connection": "close"})
        raw = await read_body(request, self.limits.max_body_bytes, self.limits.request_timeout)
        # parsed in a worker thread: a large or hostile body never holds up the other requests (/health)
        content_type = request.headers.get("content-type", "")
        data, typed = await asyncio.to_thread(parse_fields, raw, content_type, getattr(base, "file_fields", ()))
        model = self.request_model(base) if family_options else base
        try:
            return model.model_validate(data, strict=None if typed else False)
        except ValidationError as e:
            errors = [closest_field(dict(err), list(model.model_fields)) for err in e.errors()]
            raise self.option_bounds_error(errors) or RequestValidationError(errors) from None

    def option_bounds_error(self, errors: list[Any]) -> APIError | None:
        """A family option out of its bounds: 400 in the schema's words, which name the bounds and the family
        (`true_cfg_scale must be between 0 and 100 for qwenimage; got -1`), as the Python API says it; None for
        any other error (a 422 naming the field)."""
        first = dict(errors[0]) if errors else {}
        name = str((*first.get("loc", ()), "")[0])
        if name in self.engine.spec.options.names() and first.get("type") in BOUND_ERRORS:
            return APIError(400, self.engine.schema.describe(first), param=name, code="invalid_request")
        return None

    def submit(self, job: Job) -> Job:
        """Queue `job`, holding the LoRA adapter it names until it ends (so that no load evicts it and
        no unload removes it while it waits or runs)."""
        try:
            release = self.engine.hold(job.params)
        except RequestError as e:  # its adapter was unloaded since the request was validated
            raise request_error(e) from None
        try:
            self.store.submit(job)
        except BaseException:
            release()
            raise
        job.add_done_callback(lambda _job: release())
        return job


def closest_field(error: dict[str, Any], valid: list[str]) -> dict[str, Any]:
    """An unknown body field's error naming the closest valid one (`did you mean 'guidance_scale'?`), as the
    sampling schema and the config sections do."""
    loc = error.get("loc", ())
    if error.get("type") == "extra_forbidden" and len(loc) == 1:
        close = difflib.get_close_matches(str(loc[0]), valid, n=1)
        if close:
            error["msg"] = f"{error['msg']}; did you mean {close[0]!r}?"
    return error


async def get_state(request: Request) -> ServeState:
    """The app's `ServeState` (set by `create_app`). `async`: FastAPI runs a plain `def` dependency
    in its thread pool, ~0.2 ms a request (GET /health p50 on loopback, 2-core CPU: 0.75 ms with a
    `def`, 0.57 ms with this, 0.52 ms reading `request.app.state` in the route)."""
    state: ServeState = request.app.state.serve
    return state


State = Annotated[ServeState, Depends(get_state)]


def reads_body(base: type[BaseModel]) -> Callable[[F], F]:
    """Marks a route that reads its own body with `ServeState.read_request(request, base)` (bounded,
    and not by FastAPI, which would read it unbounded): `create_app` documents the body in OpenAPI
    with the served family's options."""

    def mark(endpoint: F) -> F:
        endpoint.body_model = base  # type: ignore[attr-defined]  # read by app.document_bodies
        return endpoint

    return mark


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI `requestBody` for a route's `openapi_extra`: JSON or a form, both with `model`'s fields."""
    schema = model.model_json_schema()
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}, "multipart/form-data": {"schema": schema}},
        }
    }
