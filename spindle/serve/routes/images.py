"""`POST /v1/images/generations` (OpenAI Images API) for image families: the request waits for its
job and gets base64 PNGs. A client that hangs up cancels its job (the engine stops before its next
step). A video model answers 400 pointing to `/v1/videos`, an image-editing model (it needs input
images) 400 pointing to `/v1/images/edits` (`routes/edits.py`, which shares `answer_images`).

OpenAI's knobs that Spindle cannot honour are refused at any value but the ones it can (`HONOURED`),
with a 400 naming the field and what to use instead, never accepted and silently ignored.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

from fastapi import APIRouter, Request

from spindle.contracts.request import ValidRequest
from spindle.serve.errors import APIError, ClientGone
from spindle.serve.jobs import Job, wait_done
from spindle.serve.params import lora_choice, sampling_params
from spindle.serve.schemas import ImageData, ImageGenerationRequest, ImagesResponse
from spindle.serve.state import ServeState, State, reads_body

log = logging.getLogger("spindle.serve")

router = APIRouter(tags=["images"])

# OpenAI field -> (the values this server honours, what the client is told otherwise). None is
# "not given"; the other accepted values are OpenAI's defaults, which mean "the model's own".
HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((None, False), "streaming image generation is not supported"),
    "partial_images": ((None, 0), "partial images need streaming, which is not supported"),
    "response_format": ((None, "b64_json"), "only 'b64_json' is supported (this server keeps no image URLs)"),
    "output_format": ((None, "png"), "only 'png' is supported"),
    "output_compression": ((None,), "images are lossless PNGs; there is no compression level to set"),
    "quality": (
        (None, "auto", "standard"),
        "quality presets are not mapped to this model's settings; leave quality unset (or 'auto') and set "
        "num_inference_steps (more steps: finer detail) and size instead",
    ),
    "style": ((None,), "style presets are not supported; describe the style in the prompt"),
    "background": ((None, "auto", "opaque"), "transparent backgrounds are not supported; images are opaque"),
}


def refuse_unhonoured(body: ImageGenerationRequest) -> None:
    for name, (accepted, why) in HONOURED.items():
        value = getattr(body, name)
        if value not in accepted:
            raise APIError(400, f"{name}: {why}; got {value!r}", param=name, code="unsupported_parameter")


async def wait_done_or_gone(job: Job, request: Request) -> bool:
    """Await the job's end or the client's hang-up, whichever comes first. -> the client is gone?
    (uvicorn tells a hang-up as an `http.disconnect` message once the body has been read.)"""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    done = asyncio.ensure_future(wait_done(job))
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({done, watch}, return_when=asyncio.FIRST_COMPLETED)
        return watch.done() and not job.finished
    finally:
        for task in (done, watch):
            task.cancel()


@router.post("/v1/images/generations")
@reads_body(ImageGenerationRequest)
async def images_generations(request: Request, state: State):
    engine = state.engine
    body = await state.read_request(request, ImageGenerationRequest)
    if engine.media != "image":
        raise APIError(
            400,
            f"{engine.model_id} is a {engine.media} model ({engine.family}); it does not generate "
            "images here: create a video job with POST /v1/videos",
            param="model",
            code="use_videos_endpoint",
        )
    if engine.spec.options.images[0]:
        raise APIError(
            400,
            f"{engine.model_id} ({engine.family}) edits images: send the image(s) to edit with the instruction "
            "to POST /v1/images/edits",
            param="model",
            code="use_edits_endpoint",
        )
    # (the model check first: a wrong model is the bigger mistake); in a worker thread: it decodes uploads
    valid = (await asyncio.to_thread(sampling_params, body, engine)).request
    refuse_unhonoured(body)
    return await answer_images(request, state, valid)


async def answer_images(request: Request, state: ServeState, valid: ValidRequest) -> dict[str, Any]:
    """Run an image job for a validated request and answer OpenAI's images response (generations and
    edits): the client waits; a client that hangs up cancels the job."""
    store = state.store
    job = state.submit(Job(kind="image", request=valid, model=state.engine.model_id))  # holds its adapter
    try:
        gone = await wait_done_or_gone(job, request)
    except asyncio.CancelledError:  # the server is stopping this request: do not run it for nobody
        store.cancel(job)
        store.delete(job)
        raise
    if gone:  # the client hung up: stop the work (the engine checks before each step)
        store.cancel(job)
        await wait_done(job, state.cancel_wait)
        log.info("%s: client gone, job %s at step %d/%d", job.id, job.status, job.step, job.total_steps)
        store.delete(job)
        raise ClientGone()
    try:
        if job.status == "completed":
            response: dict[str, Any] = ImagesResponse(
                created=int(job.created_at),
                data=[ImageData(b64_json=base64.b64encode(png).decode("ascii")) for png in job.images or []],
                size=f"{job.params.width}x{job.params.height}",
                model=job.model,
                seed=job.params.seed,
                lora=lora_choice(job.params, state.engine.startup_lora),
                timings=job.timings,
            ).model_dump()
            return response
        if job.status == "failed":
            err = job.error or {}
            raise APIError(
                int(err.get("status", 500)),
                err.get("message", "generation failed"),
                param=err.get("param"),
                code=err.get("code"),
                type=err.get("type"),
            )
        raise APIError(
            503, "the request was cancelled (the server is shutting down)", code="cancelled", type="server_error"
        )
    finally:
        store.delete(job)
