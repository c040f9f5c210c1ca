"""The FastAPI app: OpenAI-compatible image and video generation over one loaded model.

  GET  /health                       liveness, queue figures and limits (503 while shutting down)
  GET  /v1/models                    OpenAI list shape (one model: the loaded checkpoint, its limits)
  POST /v1/images/generations        OpenAI Images API (image families; waits, returns b64 PNGs)
  POST /v1/videos                    OpenAI Videos API: creates a job, answers at once
  GET  /v1/videos                    the stored video jobs, paginated (?limit=&after=&order=)
  GET  /v1/videos/{id}               status + progress
  GET  /v1/videos/{id}/content       the mp4 (?variant=thumbnail: PNG of frame 0; ?variant=npy: exact
                                     float32 frames when the server keeps them, --keep-frames)
  DELETE /v1/videos/{id}             cancel (queued / running) or delete (finished)

Every 4xx/5xx body is OpenAI's `{"error": {"message", "type", "param", "code"}}`. Request bodies
are read by `bodies.py` (size cap, deadline, encodings) and every field is validated by the engine
against the model and the server's limits before a job is queued (`Engine.validate`).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spindle.contracts.request import RequestError, SamplingParams
from spindle.infer.options import given_options, request_model
from spindle.serve.bodies import ClientGone, parse_fields, read_body
from spindle.serve.jobs import Job, JobStore, ShuttingDown
from spindle.serve.limits import ServeLimits
from spindle.serve.schemas import (
    APIError,
    ImageData,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    VideoCreateRequest,
    VideoError,
    VideoJob,
    error_body,
    parse_size,
    safe_text,
)
from spindle.serve.worker import Engine, Worker

log = logging.getLogger("spindle.serve")

# engine field (a RequestError's `field`) -> the HTTP request field that carries it
_FIELD_FOR = {"height": "size", "width": "size", "num_outputs_per_prompt": "n"}
_ENGINE_FIELDS = (
    "prompt",
    "negative_prompt",
    "num_inference_steps",
    "num_outputs_per_prompt",
    "guidance_scale",
    "seed",
    "height",
    "width",
    "num_frames",
    "max_sequence_length",
)
PROMPT_PREVIEW = 64  # characters of a prompt shown in the job list (a job's own GET has it whole)


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: text from a client (a lone surrogate in a field name, say)
    can never make the answer itself fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def request_error(e: RequestError, *, seconds_given: bool = False, option_names: Iterable[str] = ()) -> APIError:
    """An engine `RequestError` -> 400 naming the HTTP field (a common one or a family option)."""
    field = getattr(e, "field", None)
    param = None
    if field in tuple(option_names):
        param = field
    elif field in _ENGINE_FIELDS:
        param = _FIELD_FOR.get(field, field)
        if field == "num_frames" and seconds_given:
            param = "seconds"
    return APIError(400, str(e), param=param, code="invalid_request")


async def _wait_done(job: Job, timeout: float | None = None) -> bool:
    """Await the job's end without blocking the event loop (or a thread). -> finished?"""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    def done(_job: Job) -> None:
        loop.call_soon_threadsafe(resolve)

    job.add_done_callback(done)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
        return True
    except asyncio.TimeoutError:
        return job.finished


async def _wait_done_or_gone(job: Job, request: Request) -> bool:
    """Await the job's end or the client's hang-up, whichever comes first. -> the client is gone?
    (uvicorn tells a hang-up as an `http.disconnect` message once the body has been read.)"""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done = asyncio.ensure_future(_wait_done(job))
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
        return watch.done() and not job.finished
    finally:
        for task in (done, watch):
            task.cancel()


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

    async def drain(self) -> None:
        """Graceful stop (SIGTERM): new work gets 503 at once while job status stays readable; the
        waiting jobs are cancelled, the running one gets `shutdown_grace` s to finish and is then
        cancelled (a waiting image request answers 503 JSON); then `shutdown_linger` s more so that
        pollers read the final statuses, and the server may exit."""
        self.shutting_down = True
        log.info("shutting down: %s", self.store.stats())
        await asyncio.to_thread(self.worker.stop, self.shutdown_grace)
        log.info("worker stopped; %s; answering status for %g s more", self.store.stats(), self.shutdown_linger)
        await asyncio.sleep(self.shutdown_linger)

    async def read_request(self, request: Request, model: type[BaseModel]) -> Any:
        """The request body, bounded and decoded (`bodies.py`), validated against `model`."""
        if self.shutting_down:
            raise ShuttingDown(headers={"Connection": "close"})
        raw = await read_body(request, self.limits.max_body_bytes, self.limits.request_timeout)
        data = parse_fields(raw, request.headers.get("content-type", ""))
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    def video_job(self, job: Job, preview: bool = False) -> dict[str, Any]:
        p, meta = job.params, job.meta
        err = None
        if job.error:
            err = VideoError(code=job.error.get("code") or "error", message=job.error["message"])
        frames = p.num_frames or 1
        return VideoJob(
            id=job.id,
            model=job.model,
            status=job.status,
            progress=job.progress,
            created_at=int(job.created_at),
            completed_at=int(job.completed_at) if job.completed_at else None,
            expires_at=int(job.expires_at) if job.expires_at else None,
            prompt=_preview(p.prompt) if preview else p.prompt if isinstance(p.prompt, str) else None,
            seconds=f"{frames / self.engine.fps:g}",
            size=f"{p.width}x{p.height}",
            error=err,
            num_frames=p.num_frames,
            fps=self.engine.fps,
            seed=p.seed,
            num_inference_steps=p.num_inference_steps,
            guidance_scale=p.guidance_scale,
            queue_position=self.store.queue_position(job) if job.status == "queued" else None,
            notes=list(meta.get("notes", [])),
            timings=job.timings,
            deleted=meta.get("deleted"),
        ).model_dump()


def _preview(prompt: Any) -> str | None:
    if not isinstance(prompt, str):
        return None
    return prompt if len(prompt) <= PROMPT_PREVIEW else prompt[: PROMPT_PREVIEW - 1] + "…"


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
    async def lifespan(app: FastAPI):
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

    # ---------------------------------------------------------------- errors (OpenAI shape)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return SafeJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone):
        # nobody reads this answer (uvicorn drops it); it only ends the request without a traceback
        log.info("%s %s: the client hung up", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, params = [], []
        for err in errors:
            loc = [safe_text(str(x)) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
            name = ".".join(loc) or "body"
            params.append(name)
            parts.append(f"{name}: {err.get('msg')}")
        return SafeJSONResponse(
            error_body(
                "; ".join(parts) or "invalid request",
                "invalid_request_error",
                params[0] if params else None,
                "invalid_value",
            ),
            status_code=422,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {safe_text(request.url.path)}"
        return SafeJSONResponse(
            error_body(
                message,
                "invalid_request_error" if exc.status_code < 500 else "server_error",
                None,
                str(exc.status_code),
            ),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return SafeJSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"),
            status_code=500,
        )

    # ---------------------------------------------------------------- meta

    @app.get("/health")
    async def health():
        ok = worker.alive and not state.shutting_down and not store.closed
        body = {
            "status": "ok" if ok else "shutting_down" if state.shutting_down else "unavailable",
            "model": engine.model_id,
            "media": engine.media,
            "queue": store.stats(),
            "limits": state.limits.as_dict(),
        }
        return SafeJSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> ModelCard:
        return ModelCard(
            id=engine.model_id,
            created=state.created,
            family=engine.family,
            media=engine.media,
            root=engine.root,
            limits=state.limits.as_dict(),
        )

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_id:
            raise APIError(
                404,
                f"model {safe_text(model_id)!r} is not served here; this server serves {engine.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return model_card().model_dump()

    # ---------------------------------------------------------------- images

    def body_schema(model: type[BaseModel]) -> dict[str, Any]:
        """OpenAPI for a body read by `read_request` (not by FastAPI, which would read it unbounded)."""
        return {
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": model.model_json_schema()},
                    "multipart/form-data": {"schema": model.model_json_schema()},
                },
            }
        }

    # the request bodies carry the served family's declared options (e.g. true_cfg_scale) as fields
    options = engine.spec.options
    image_request = request_model(ImageGenerationRequest, options)
    video_request = request_model(VideoCreateRequest, options)

    @app.post("/v1/images/generations", openapi_extra=body_schema(image_request))
    async def images_generations(request: Request):
        body: ImageGenerationRequest = await state.read_request(request, image_request)
        if engine.media != "image":
            raise APIError(
                400,
                f"{engine.model_id} is a {engine.media} model ({engine.family}); it does not generate "
                "images here: create a video job with POST /v1/videos",
                param="model",
                code="use_videos_endpoint",
            )
        if body.stream:
            raise APIError(
                400, "stream: streaming image generation is not supported", param="stream", code="unsupported_parameter"
            )
        if body.response_format not in (None, "b64_json"):
            raise APIError(
                400,
                "response_format: only 'b64_json' is supported (this server keeps no image URLs)",
                param="response_format",
                code="unsupported_parameter",
            )
        if body.output_format not in (None, "png"):
            raise APIError(
                400, "output_format: only 'png' is supported", param="output_format", code="unsupported_parameter"
            )
        size = parse_size(body.size)
        params = SamplingParams(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            num_outputs_per_prompt=body.n or 1,
            extra=given_options(body, options),
        )
        try:
            params = engine.validate(params)
        except RequestError as e:
            raise request_error(e, option_names=options.names()) from None
        job = store.submit(Job(kind="image", params=params, model=engine.model_id))
        try:
            gone = await _wait_done_or_gone(job, request)
        except asyncio.CancelledError:  # the server is stopping this request: do not run it for nobody
            store.cancel(job)
            store.delete(job)
            raise
        if gone:  # the client hung up: stop the work (the engine checks before each step)
            store.cancel(job)
            await _wait_done(job, state.cancel_wait)
            log.info("%s: client gone, job %s at step %d/%d", job.id, job.status, job.step, job.total_steps)
            store.delete(job)
            raise ClientGone()
        try:
            if job.status == "completed":
                return ImagesResponse(
                    created=int(job.created_at),
                    data=[ImageData(b64_json=_b64(png)) for png in job.images or []],
                    size=f"{params.width}x{params.height}",
                    seed=params.seed,
                    timings=job.timings,
                ).model_dump()
            if job.status == "failed":
                err = job.error or {}
                raise APIError(
                    int(err.get("status", 500)),
                    err.get("message", "generation failed"),
                    code=err.get("code"),
                    type=err.get("type"),
                )
            raise APIError(
                503, "the request was cancelled (the server is shutting down)", code="cancelled", type="server_error"
            )
        finally:
            store.delete(job)

    # ---------------------------------------------------------------- videos

    @app.post("/v1/videos", openapi_extra=body_schema(video_request))
    async def create_video(request: Request):
        body: VideoCreateRequest = await state.read_request(request, video_request)
        if engine.media != "video":
            raise APIError(
                400,
                f"{engine.model_id} is an {engine.media} model ({engine.family}); generate images "
                "with POST /v1/images/generations",
                param="model",
                code="use_images_endpoint",
            )
        notes = []
        num_frames = body.num_frames
        if body.seconds is not None:
            if num_frames is not None:
                raise APIError(
                    400, "seconds: give either num_frames or seconds, not both", param="seconds", code="invalid_request"
                )
            num_frames, note = engine.frames_for_seconds(body.seconds)
            if note:
                notes.append(note)
        size = parse_size(body.size)
        params = SamplingParams(
            prompt=body.prompt,
            negative_prompt=body.negative_prompt,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_frames=num_frames,
            num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale,
            seed=body.seed,
            extra=given_options(body, options),
        )
        try:
            params = engine.validate(params)
        except RequestError as e:
            raise request_error(e, seconds_given=body.seconds is not None, option_names=options.names()) from None
        job = Job(kind="video", params=params, model=engine.model_id, meta={"notes": notes})
        store.submit(job)
        return state.video_job(job)

    @app.get("/v1/videos")
    async def list_videos(
        limit: int = Query(20, ge=1, le=100),
        after: str | None = Query(None, max_length=200),
        order: str = Query("desc", pattern="^(asc|desc)$"),
    ):
        """OpenAI's list shape: newest first (`order=desc`) by default; `after` = the last id of
        the previous page. Prompts are shortened to a preview here (a job's GET has it whole)."""
        jobs, has_more = store.page("video", limit=limit, after=after, newest_first=order == "desc")
        data = [state.video_job(j, preview=True) for j in jobs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        return state.video_job(store.get(video_id, "video"))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        job = store.get(video_id, "video")
        if variant not in ("video", "thumbnail", "npy"):
            raise APIError(
                400,
                f"variant must be 'video', 'thumbnail' or 'npy'; got {safe_text(variant)!r}",
                param="variant",
                code="unsupported_parameter",
            )
        if job.status == "failed":
            err = job.error or {}
            raise APIError(
                int(err.get("status", 500)),
                f"{video_id} failed: {err.get('message', 'generation failed')}",
                code=err.get("code") or "generation_failed",
                type=err.get("type"),
            )
        if job.status == "cancelled":
            raise APIError(
                409, f"{video_id} was cancelled; it has no content", param="video_id", code="video_cancelled"
            )
        if job.status != "completed":
            raise APIError(
                409,
                f"{video_id} is not ready (status {job.status}, progress {job.progress}%)",
                param="video_id",
                code="video_not_ready",
            )
        content = job.content
        assert content is not None  # the worker sets it before finishing a video job as completed
        if variant == "video":
            return Response(
                content,
                media_type="video/mp4",
                headers={"Content-Disposition": f'attachment; filename="{video_id}.mp4"'},
            )
        if variant == "thumbnail":
            thumb = job.meta.get("thumbnail")
            if thumb is None:
                thumb = job.meta["thumbnail"] = await asyncio.to_thread(_thumbnail, content)
            return Response(thumb, media_type="image/png")
        if job.frames is None:
            raise APIError(
                400,
                "variant 'npy' (exact float32 frames) needs a server started with --keep-frames",
                param="variant",
                code="unsupported_parameter",
            )
        import numpy as np

        buf = io.BytesIO()
        np.save(buf, job.frames)
        return Response(buf.getvalue(), media_type="application/octet-stream")

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str):
        job = store.get(video_id, "video")
        if job.finished:
            store.delete(job)
            job.meta["deleted"] = True
            return state.video_job(job)
        store.cancel(job)
        if not job.finished:  # running: the engine stops before its next denoising step
            await _wait_done(job, state.cancel_wait)
        return state.video_job(job)

    return app


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode("ascii")


def _thumbnail(mp4: bytes) -> bytes:
    """PNG of the first frame of an mp4."""
    import av

    from spindle.serve.worker import encode_png

    with av.open(io.BytesIO(mp4)) as container:
        frame = next(container.decode(video=0)).to_ndarray(format="rgb24")
    return encode_png(frame)
