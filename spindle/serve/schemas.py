"""HTTP request/response schemas (pydantic 2), shaped like OpenAI's Images and Videos APIs.

Unknown request fields are refused (422 naming the field), except the OpenAI fields a stock client
may send, which are accepted and either honoured or refused with a 400 naming them when Spindle
cannot honour their value (e.g. `response_format="url"`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spindle.contracts.request import short_repr

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
TERMINAL_STATUSES = ("completed", "failed", "cancelled")

# at most 9 digits a side: int() of a 5000-digit string is refused by Python (ValueError), and
# anything past 9 digits is beyond every pixel limit anyway
_SIZE = re.compile(r"^\s*(\d{1,9})\s*[xX×]\s*(\d{1,9})\s*$")


def safe_text(text: str, limit: int = 64) -> str:
    """Client text fit to echo in an error: at most `limit` characters, lone surrogates escaped
    (they cannot be encoded as UTF-8, so echoing them would break the JSON answer itself)."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


class _Sampling(BaseModel):
    """Sampling extras Spindle accepts on top of OpenAI's fields (all optional: model defaults)."""

    model_config = ConfigDict(extra="forbid")

    # upper bounds (steps, prompt length, ...) are the server's limits, checked by the engine's validation
    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class ImageGenerationRequest(_Sampling):
    """`POST /v1/images/generations` (OpenAI Images API)."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int | None = Field(default=1, ge=1)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "webp", "jpeg", "gif", "svg"] | None = None
    stream: bool | None = None
    # accepted for compatibility with OpenAI clients, no effect here
    quality: str | None = None
    style: str | None = None
    user: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = None
    safety_identifier: str | None = None
    partial_images: int | None = None


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str = "png"
    size: str | None = None
    # Spindle extras
    seed: int | None = None
    timings: dict[str, float] = Field(default_factory=dict)


class VideoCreateRequest(_Sampling):
    """`POST /v1/videos` (OpenAI Videos API; JSON, or the multipart form the openai client sends)."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = None
    seconds: float | None = Field(default=None, gt=0, le=3600, allow_inf_nan=False)
    num_frames: int | None = Field(default=None, ge=1)


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """OpenAI's Video object plus Spindle's extras (frames, fps, seed, notes, queue position)."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: JobStatus
    progress: int = 0
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    prompt: str | None = None
    seconds: str
    size: str
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    # Spindle extras
    num_frames: int | None = None
    fps: int | None = None
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    queue_position: int | None = None
    notes: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    deleted: bool | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spindle"
    # Spindle extras
    family: str
    media: str
    root: str | None = None
    limits: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
