"""OpenAI's Videos API for video families: jobs that answer at once and are polled.

  POST   /v1/videos                create a job (JSON, or the multipart form the openai client sends)
  GET    /v1/videos                the stored jobs, paginated (?limit=&after=&order=)
  GET    /v1/videos/{id}           status + progress
  GET    /v1/videos/{id}/content   the mp4 (?variant=thumbnail: PNG of frame 0; ?variant=npy: exact
                                   float32 frames when the server keeps them, --keep-frames)
  DELETE /v1/videos/{id}           cancel (queued / running) or delete (finished)

An image model answers `POST /v1/videos` with a 400 pointing to `/v1/images/generations`.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from spindle.serve.errors import APIError, safe_text
from spindle.serve.jobs import Job, wait_done
from spindle.serve.params import lora_choice, sampling_params
from spindle.serve.schemas import VideoCreateRequest, VideoError, VideoJob
from spindle.serve.state import ServeState, State, reads_body

router = APIRouter(tags=["videos"])

PROMPT_PREVIEW = 64  # characters of a prompt shown in the job list (a job's own GET has it whole)


def video_object(state: ServeState, job: Job, preview: bool = False) -> dict[str, Any]:
    """OpenAI's Video object for a job, plus Spindle's extras."""
    p, meta, engine = job.params, job.meta, state.engine
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
        seconds=f"{frames / engine.fps:g}",
        size=f"{p.width}x{p.height}",
        error=err,
        num_frames=p.num_frames,
        fps=engine.fps,
        seed=p.seed,
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        lora=lora_choice(p, engine.startup_lora),
        queue_position=state.store.queue_position(job) if job.status == "queued" else None,
        notes=list(meta.get("notes", [])),
        timings=job.timings,
        deleted=meta.get("deleted"),
    ).model_dump()


def _preview(prompt: Any) -> str | None:
    if not isinstance(prompt, str):
        return None
    return prompt if len(prompt) <= PROMPT_PREVIEW else prompt[: PROMPT_PREVIEW - 1] + "…"


@router.post("/v1/videos")
@reads_body(VideoCreateRequest)
async def create_video(request: Request, state: State):
    engine = state.engine
    body = await state.read_request(request, VideoCreateRequest)
    if engine.media != "video":
        raise APIError(
            400,
            f"{engine.model_id} is an {engine.media} model ({engine.family}); generate images "
            "with POST /v1/images/generations",
            param="model",
            code="use_images_endpoint",
        )
    planned = await asyncio.to_thread(sampling_params, body, engine)  # decodes uploads: off the event loop
    job = Job(kind="video", request=planned.request, model=engine.model_id, meta={"notes": planned.notes})
    state.submit(job)
    return video_object(state, job)


@router.get("/v1/videos")
async def list_videos(
    state: State,
    limit: int = Query(20, ge=1, le=100),
    after: str | None = Query(None, max_length=200),
    order: str = Query("desc", pattern="^(asc|desc)$"),
):
    """OpenAI's list shape: newest first (`order=desc`) by default; `after` = the last id of
    the previous page. Prompts are shortened to a preview here (a job's GET has it whole)."""
    jobs, has_more = state.store.page("video", limit=limit, after=after, newest_first=order == "desc")
    data = [video_object(state, j, preview=True) for j in jobs]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, state: State):
    return video_object(state, state.store.get(video_id, "video"))


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, state: State, variant: str = "video"):
    job = state.store.get(video_id, "video")
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
        raise APIError(409, f"{video_id} was cancelled; it has no content", param="video_id", code="video_cancelled")
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


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, state: State):
    job = state.store.get(video_id, "video")
    if job.finished:
        state.store.delete(job)
        job.meta["deleted"] = True
        return video_object(state, job)
    state.store.cancel(job)
    if not job.finished:  # running: the engine stops before its next denoising step
        await wait_done(job, state.cancel_wait)
    return video_object(state, job)


def _thumbnail(mp4: bytes) -> bytes:
    """PNG of the first frame of an mp4."""
    import av

    from spindle.serve.worker import encode_png

    with av.open(io.BytesIO(mp4)) as container:
        frame = next(container.decode(video=0)).to_ndarray(format="rgb24")
    return encode_png(frame)
