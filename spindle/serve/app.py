"""The FastAPI app: OpenAI-compatible image and video generation over one loaded model.

  GET  /health                       liveness + queue figures (503 while shutting down)
  GET  /v1/models                    OpenAI list shape (one model: the loaded checkpoint)
  POST /v1/images/generations        OpenAI Images API (image families; waits, returns b64 PNGs)
  POST /v1/videos                    OpenAI Videos API: creates a job, answers at once
  GET  /v1/videos                    the stored video jobs
  GET  /v1/videos/{id}               status + progress
  GET  /v1/videos/{id}/content       the mp4 (?variant=thumbnail: PNG of frame 0; ?variant=npy: exact
                                     float32 frames when the server keeps them, --keep-frames)
  DELETE /v1/videos/{id}             cancel (queued / running) or delete (finished)

Every 4xx/5xx body is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import email.utils
import io
import json
import logging
import time
import urllib.parse
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from spindle.infer.request import RequestError, SamplingParams
from spindle.serve.jobs import Job, JobStore
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
)
from spindle.serve.worker import Engine, Worker

log = logging.getLogger("spindle.serve")

# engine field (first word of a RequestError) -> the HTTP request field that carries it
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


def request_error(e: RequestError, *, seconds_given: bool = False) -> APIError:
    """An engine `RequestError` -> 400 naming the HTTP field."""
    message = str(e)
    first = message.split(" ", 1)[0].strip(":,;")
    param = None
    if first in _ENGINE_FIELDS:
        param = _FIELD_FOR.get(first, first)
        if first == "num_frames" and seconds_given:
            param = "seconds"
    return APIError(400, message, param=param, code="invalid_request")


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


def _parse_form(body: bytes, content_type: str) -> dict[str, Any]:
    """multipart/form-data (what the openai client sends to /videos) or urlencoded -> fields.
    Stdlib only (FastAPI's form support needs python-multipart)."""
    if content_type.startswith("application/x-www-form-urlencoded"):
        return {k: v[-1] for k, v in urllib.parse.parse_qs(body.decode("utf-8"), keep_blank_values=True).items()}
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        raise APIError(400, "malformed multipart/form-data body", code="invalid_body")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        # an RFC 2231 encoded name comes back as a (charset, language, value) tuple
        name = email.utils.collapse_rfc2231_value(part.get_param("name", header="content-disposition") or "")
        if not name:
            continue
        if part.get_filename() is not None:
            raise APIError(
                400,
                f"{name}: file uploads are not supported (text-to-video only)",
                param=name,
                code="unsupported_parameter",
            )
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""  # a nested multipart part has no bytes
        fields[name] = data.decode(part.get_content_charset() or "utf-8")
    return fields


class ServeState:
    """What the routes share: the engine, the store, the worker and settings."""

    def __init__(self, engine: Engine, store: JobStore, worker: Worker, shutdown_grace: float, cancel_wait: float):
        self.engine = engine
        self.store = store
        self.worker = worker
        self.shutdown_grace = shutdown_grace
        self.cancel_wait = cancel_wait
        self.created = int(time.time())
        self.shutting_down = False

    def video_job(self, job: Job) -> dict[str, Any]:
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
            prompt=p.prompt if isinstance(p.prompt, str) else None,
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


def create_app(
    engine: Engine, store: JobStore, worker: Worker, *, shutdown_grace: float = 30.0, cancel_wait: float = 10.0
) -> FastAPI:
    """The app over a loaded engine. The worker thread starts with the app (lifespan) and stops
    with it: no new jobs, waiting ones cancelled, the running one finished (or cancelled after
    `shutdown_grace` s)."""
    state = ServeState(engine, store, worker, shutdown_grace, cancel_wait)

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

    app = FastAPI(title="Spindle", version="0.1.0", lifespan=lifespan)
    app.state.serve = state

    # ---------------------------------------------------------------- errors (OpenAI shape)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        parts, params = [], []
        for err in errors:
            loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "query", "path")]
            name = ".".join(loc) or "body"
            params.append(name)
            parts.append(f"{name}: {err.get('msg')}")
        return JSONResponse(
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
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(
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
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"),
            status_code=500,
        )

    # ---------------------------------------------------------------- meta

    @app.get("/health")
    async def health():
        ok = worker.alive and not state.shutting_down and not store.closed
        body = {
            "status": "ok" if ok else "unavailable",
            "model": engine.model_id,
            "media": engine.media,
            "queue": store.stats(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    def model_card() -> ModelCard:
        return ModelCard(
            id=engine.model_id, created=state.created, family=engine.family, media=engine.media, root=engine.root
        )

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != engine.model_id:
            raise APIError(
                404,
                f"model {model_id!r} is not served here; this server serves {engine.model_id!r}",
                param="model",
                code="model_not_found",
            )
        return model_card().model_dump()

    # ---------------------------------------------------------------- images

    @app.post("/v1/images/generations")
    async def images_generations(body: ImageGenerationRequest):
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
        )
        try:
            params = engine.validate(params)
        except RequestError as e:
            raise request_error(e) from None
        job = store.submit(Job(kind="image", params=params, model=engine.model_id))
        try:
            await _wait_done(job)
        except asyncio.CancelledError:  # the client went away: do not run it for nobody
            store.cancel(job)
            raise
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

    @app.post("/v1/videos")
    async def create_video(request: Request):
        content_type = request.headers.get("content-type", "").lower()
        raw = await request.body()
        if content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
            data = _parse_form(raw, content_type)
        else:
            try:
                data = json.loads(raw or b"null")
            except json.JSONDecodeError as e:
                raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
            if not isinstance(data, dict):
                raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = VideoCreateRequest.model_validate(data)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
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
        )
        try:
            params = engine.validate(params)
        except RequestError as e:
            raise request_error(e, seconds_given=body.seconds is not None) from None
        job = Job(kind="video", params=params, model=engine.model_id, meta={"notes": notes})
        store.submit(job)
        return state.video_job(job)

    @app.get("/v1/videos")
    async def list_videos():
        return {"object": "list", "data": [state.video_job(j) for j in store.list("video")]}

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str):
        return state.video_job(store.get(video_id, "video"))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video"):
        job = store.get(video_id, "video")
        if variant not in ("video", "thumbnail", "npy"):
            raise APIError(
                400,
                f"variant must be 'video', 'thumbnail' or 'npy'; got {variant!r}",
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
