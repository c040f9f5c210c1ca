"""A generation request body -> the `ValidRequest` a job runs: the one mapping every generation route uses
(images and videos today; edits and per-request adapters add their fields here).

OpenAI's fields are read as OpenAI defines them (`size` "WIDTHxHEIGHT", `n` outputs, `seconds` of
video at the model's fps), the request's `model` must name the served model (or an OpenAI default
name, below), and the result is validated once by the engine (the family's sampling schema, the model and
the server's limits) before any job exists, so every refusal is a 4xx naming the HTTP field; the job then
runs the validated request as it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spindle.contracts.images import count_images, decode_upload, with_last_image
from spindle.contracts.request import RequestError, SamplingParams, ValidRequest, short_repr
from spindle.infer.options import given_options
from spindle.serve.engine import output_size_params
from spindle.serve.errors import APIError, request_error, safe_text
from spindle.serve.schemas import GenerationRequest, ImageGenerationRequest, LoraChoice, VideoCreateRequest

if TYPE_CHECKING:
    from spindle.serve.engine import Engine

# The model names OpenAI's clients and examples send by default, per media: a request naming one is
# served by the loaded model (a client written for OpenAI works unchanged). Any other name that is
# not the served model's id is refused: the client asked for a model this server does not have.
OPENAI_MODEL_ALIASES: dict[str, tuple[str, ...]] = {
    "image": ("dall-e-2", "dall-e-3", "gpt-image-1", "gpt-image-1-mini"),
    "video": ("sora-2", "sora-2-pro"),
}

# at most 9 digits a side: int() of a 5000-digit string is refused by Python (ValueError), and
# anything past 9 digits is beyond every pixel limit anyway
_SIZE = re.compile(r"^\s*(\d{1,9})\s*[xX×]\s*(\d{1,9})\s*$")


def parse_size(size: str | None) -> tuple[int, int] | None:
    """OpenAI's `size` "WIDTHxHEIGHT" -> (width, height); None / "auto" -> None (model default)."""
    if size is None or (isinstance(size, str) and size.strip().lower() == "auto"):
        return None
    m = _SIZE.match(size) if isinstance(size, str) else None
    if not m:
        raise APIError(
            400,
            f"size must be 'WIDTHxHEIGHT' in pixels (e.g. '832x480') or 'auto'; got {short_repr(size)}",
            param="size",
            code="invalid_size",
        )
    width, height = int(m.group(1)), int(m.group(2))
    if width < 1 or height < 1:
        raise APIError(
            400, f"size must have a positive width and height; got {size}", param="size", code="invalid_size"
        )
    return width, height


def model_aliases(engine: Engine) -> list[str]:
    """The other names a request's `model` may give the served model (OpenAI's defaults for its media)."""
    return [a for a in OPENAI_MODEL_ALIASES.get(engine.media, ()) if a != engine.model_id]


def check_model(requested: str | None, engine: Engine) -> None:
    """A request's `model` must be the served model's id or one of its aliases (None: the served
    model). Anything else is a 404 naming `model` and the names this server answers to."""
    if requested is None or requested == engine.model_id or requested in model_aliases(engine):
        return
    also = ", ".join(repr(a) for a in model_aliases(engine))
    raise APIError(
        404,
        f"model {safe_text(requested)!r} is not served here; this server serves {engine.model_id!r}"
        f" ({engine.family}, {engine.media})" + (f"; OpenAI's default names {also} also reach it" if also else ""),
        param="model",
        code="model_not_found",
    )


def uploaded_images(body: GenerationRequest, engine: Engine) -> list[Any] | None:
    """The input image(s) of a request (its route's `image_field`: one upload / data URL, or a list; then a
    first-last-frame model's `last_image`), counted against what the family takes before any is decoded, then
    decoded (`spindle.contracts.images.decode_upload`, the images' one home). Whether the family takes images at
    all is the engine's check (its message names the family)."""
    name = body.image_field
    value = None if name is None else getattr(body, name, None)
    last = getattr(body, "last_image", None)
    if name is None or (value is None and last is None):
        return None
    items = with_last_image(value, last, image_name=name, first="an input_reference") or []
    try:  # counted before any upload is decoded; the engine's count rule, in the route's field name
        count_images(items, engine.spec.options.images, engine.family, name=name)
    except RequestError as e:
        raise APIError(400, str(e), param=name, code=e.code) from None
    names = [name] * len(items) if last is None else [name, "last_image"]
    try:
        return [decode_upload(item, param, engine.limits.max_pixels) for item, param in zip(items, names, strict=True)]
    except RequestError as e:  # the upload's own field and problem
        raise APIError(400, str(e), param=e.field, code=e.code) from None


@dataclass
class Planned:
    """A validated request: what a job runs (defaults filled, seed drawn) and notes for the client (e.g.
    how `seconds` became a frame count)."""

    request: ValidRequest
    notes: list[str] = field(default_factory=list)


def sampling_params(body: GenerationRequest, engine: Engine) -> Planned:
    """The one body -> params mapping: the common fields, the media's own (`n` for images;
    `num_frames` or `seconds` for videos) and the served family's options, validated by the engine.
    Raises `APIError` naming the HTTP field."""
    check_model(body.model, engine)
    notes: list[str] = []
    outputs, num_frames, seconds_given = 1, None, False
    if isinstance(body, ImageGenerationRequest):
        outputs = body.n or 1
    if isinstance(body, VideoCreateRequest):
        num_frames = body.num_frames
        if body.seconds is not None:
            if num_frames is not None:
                raise APIError(
                    400, "seconds: give either num_frames or seconds, not both", param="seconds", code="invalid_request"
                )
            seconds_given = True
            num_frames, note = engine.frames_for_seconds(body.seconds)
            if note:
                notes.append(note)
    size = parse_size(body.size)
    options = engine.spec.options
    try:
        images = uploaded_images(body, engine)
    except RequestError as e:  # last_image without its first frame
        raise APIError(400, str(e), param=e.field, code=e.code) from None
    params = SamplingParams(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        num_frames=num_frames,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        seed=body.seed,
        num_outputs_per_prompt=outputs,
        image=images,
        lora=body.lora,
        lora_scale=body.lora_scale,
        extra=given_options(body, options),
    )
    given = set(params.extra)  # the family options the request gave itself
    if size is not None:  # OpenAI's `size` is the output's: an area-sized model's area follows it
        params = output_size_params(params, size, options)
    try:
        return Planned(engine.validate(params), notes)
    except RequestError as e:
        error = request_error(
            e, seconds_given=seconds_given, option_names=options.names(), image_field=body.image_field
        )
        set_by_size = {o.name for o in options.extra if o.output_area} - given
        if size is not None and (error.param == "size" or e.field in set_by_size):
            raise size_error(error, size, params, engine) from None
        raise error from None


SIZE_STEP = 4  # every served family's sizes are multiples of 4 (a tiny VAE x2 x 2x2 packing) or of a multiple of it
SIZE_REACH = 8  # candidates: this many steps either side of each asked side


def nearest_sizes(size: tuple[int, int], params: SamplingParams, engine: Engine, count: int = 3) -> list[str]:
    """The sizes nearest `size` = (width, height) that the model makes with the rest of `params` as asked:
    candidates on the `SIZE_STEP` grid around each side, nearest first, each checked by the engine itself
    (its own sizing rules, e.g. an area-sized model's rounding), so no family rule is repeated here."""
    import dataclasses

    def grid(side: int) -> list[int]:
        base = side // SIZE_STEP * SIZE_STEP
        return [
            v for v in range(base - SIZE_REACH * SIZE_STEP, base + (SIZE_REACH + 1) * SIZE_STEP, SIZE_STEP) if v > 0
        ]

    width, height = size
    candidates = sorted(
        ((w, h) for w in grid(width) for h in grid(height)), key=lambda c: (abs(c[0] - width) + abs(c[1] - height), c)
    )
    found: list[str] = []
    for w, h in candidates:
        extra = {
            k: v
            for k, v in params.extra.items()
            if k not in {o.name for o in engine.spec.options.extra if o.output_area}
        }
        trial = output_size_params(dataclasses.replace(params, extra=extra), (w, h), engine.spec.options)
        try:
            engine.validate(trial)
        except RequestError:
            continue
        found.append(f"{w}x{h}")
        if len(found) == count:
            break
    return found


def size_error(error: APIError, size: tuple[int, int], params: SamplingParams, engine: Engine) -> APIError:
    """A `size` the model cannot make (the engine refused its height, width, or the output area it set):
    400 naming `size`, the engine's reason and the nearest sizes it makes."""
    nearest = nearest_sizes(size, params, engine)
    message = error.message if error.param == "size" else f"size: {size[0]}x{size[1]} sets {error.message}"
    hint = f"; nearest sizes it makes: {', '.join(nearest)}" if nearest else ""
    return APIError(400, message + hint, param="size", code="invalid_request")


def lora_choice(params: SamplingParams, startup: LoraChoice | None = None) -> LoraChoice | None:
    """The adapter a job runs with, for its response: the request's own, else the one the server was started
    with (`--lora`, applied at load: `Engine.startup_lora`); None: the model alone."""
    if params.lora is None:
        return startup
    return LoraChoice(name=params.lora, scale=1.0 if params.lora_scale is None else params.lora_scale)
