"""Errors in OpenAI's shape, shared by every route: `APIError`, the app's exception handlers, and
the mapping of an engine `RequestError` onto the HTTP field that carried the bad value.

Every 4xx/5xx body is `{"error": {"message", "type", "param", "code"}}`. `param` and the message
name the field as the client sent it (`n`, `size`, `seconds`), never the engine's name for it
(`num_outputs_per_prompt`, `width`, `num_frames`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

from spindle.contracts.request import RequestError, safe_text

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("spindle.serve")

# engine field -> the HTTP field that is the same value under another name: the message says the HTTP name
_RENAMED = {"num_outputs_per_prompt": "n", "image": "input_reference"}
# engine field -> the HTTP field it is a part of (`size` is "WIDTHxHEIGHT"): the message is prefixed with it
_PART_OF = {"height": "size", "width": "size"}
# the common engine fields a request body carries (under their own name unless listed above)
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
    "image",
    "lora",
    "lora_scale",
    "last_image",
)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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

    def as_job_error(self) -> dict[str, Any]:
        """What a job stores for a failure (a video job's `error`, the images route's answer)."""
        return {
            "status": self.status,
            "message": self.message,
            "type": self.type,
            "code": self.code,
            "param": self.param,
        }


def _default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


class ClientGone(Exception):
    """The client closed its connection before the answer (nothing to answer, nothing to log)."""


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: text from a client (a lone surrogate in a field name, say)
    can never make the answer itself fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def request_error(
    e: RequestError, *, seconds_given: bool = False, option_names: Iterable[str] = (), image_field: str | None = None
) -> APIError:
    """An engine `RequestError` -> 400 naming the HTTP field (a common one or a family option),
    in `param` and in the message. `image_field`: the route's name for the input images (/v1/videos
    `input_reference`, the default; /v1/images/edits `image`)."""
    field = getattr(e, "field", None)
    message = str(e)
    param = None
    renamed = {**_RENAMED, "image": image_field or _RENAMED["image"]}
    if field in tuple(option_names):
        param = field
    elif field in _ENGINE_FIELDS:
        param = renamed.get(field) or _PART_OF.get(field) or field
        if field == "num_frames" and seconds_given:
            param = "seconds"  # the engine's frame count was computed from `seconds`
        if field in renamed and param != field:
            message = re.sub(rf"\b{field}\b", param, message, count=1)  # the leading name (not "image(s)")
        elif param != field and not message.startswith(param):
            message = f"{param}: {message}"
    return APIError(400, message, param=param, code=getattr(e, "code", "invalid_request"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app can meet answered in OpenAI's shape: ours (`APIError`), FastAPI's
    validation (422 naming the field), Starlette's (404 route, 405, ...), and anything unexpected
    (500, logged with its traceback). A client's hang-up ends the request quietly."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return SafeJSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        # nobody reads this answer (uvicorn drops it); it only ends the request without a traceback
        log.info("%s %s: the client hung up", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        parts, params = [], []
        for err in exc.errors():
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
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
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
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return SafeJSONResponse(
            error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"),
            status_code=500,
        )
