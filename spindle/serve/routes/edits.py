"""`POST /v1/images/edits` (OpenAI Images API) for image-editing families (Qwen-Image-Edit): the
instruction and the image(s) to edit, as a multipart upload (`image`, repeated or `image[]` for
several, as the openai client sends a list) or JSON with base64 data URLs; the answer is the images
response of `/v1/images/generations` (base64 PNGs; the request waits for its job).

Refused before any job exists, each a 4xx naming the field: a model that edits no images (text-to-image:
400 naming `model`, it takes no input image; a video model: pointed to `/v1/videos`), a `mask`
(inpainting is not supported), an upload that is not an image / of another type / larger than
`--max-pixels` / more images than the family takes (`params.uploaded_images`), and the generation
route's unhonoured OpenAI values.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from spindle.serve.errors import APIError
from spindle.serve.params import sampling_params
from spindle.serve.routes.images import answer_images, refuse_unhonoured
from spindle.serve.schemas import ImageEditRequest
from spindle.serve.state import State, reads_body

router = APIRouter(tags=["images"])


@router.post("/v1/images/edits")
@reads_body(ImageEditRequest)
async def images_edits(request: Request, state: State):
    engine = state.engine
    body = await state.read_request(request, ImageEditRequest)
    if engine.media != "image":
        raise APIError(
            400,
            f"{engine.model_id} is a {engine.media} model ({engine.family}); it does not edit images: create a video "
            "job with POST /v1/videos (input_reference for an image-to-video model)",
            param="model",
            code="use_videos_endpoint",
        )
    if not engine.spec.options.images[1]:
        raise APIError(
            400,
            f"{engine.model_id} ({engine.family}) generates images from text alone and takes no input image, so it "
            "cannot edit one: serve an image-editing model (e.g. Qwen-Image-Edit), or use POST /v1/images/generations",
            param="model",
            code="model_does_not_edit",
        )
    if body.mask is not None:
        raise APIError(
            400,
            "mask: inpainting masks are not supported; this model edits the whole image from the instruction "
            "(send the request without a mask)",
            param="mask",
            code="unsupported_parameter",
        )
    if body.input_fidelity is not None:
        raise APIError(
            400,
            f"input_fidelity: not mapped to this model's settings; leave it unset (got {body.input_fidelity!r})",
            param="input_fidelity",
            code="unsupported_parameter",
        )
    valid = (await asyncio.to_thread(sampling_params, body, engine)).request  # decodes uploads: off the event loop
    refuse_unhonoured(body)
    return await answer_images(request, state, valid)
