"""Reading and decoding request bodies defensively: a size cap (413), a deadline for a half-sent
body (408), a client hang-up mid-body (no traceback), then JSON or form fields -> a dict, with
every malformed input a 400 that says what is wrong (invalid UTF-8, bad JSON, nesting too deep,
unknown charset, broken multipart) instead of an exception escaping to a 500."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import Iterable
from typing import Any

from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request

from spindle.contracts.images import UploadedFile
from spindle.serve.errors import APIError, ClientGone, safe_text
from spindle.serve.limits import MAX_FORM_FIELDS, MAX_FORM_FILES

# integer literals longer than this become floats (inf past ~308 digits): Python refuses int() of
# more than 4300 digits with a ValueError, and no field takes numbers that large anyway; the
# field's own validation then names it ("should be a finite number" / "less than ...")
_MAX_INT_DIGITS = 100
DISCARD_SECONDS = 2.0  # how long an oversize body is read (and dropped) before the 413 goes out
_CLOSE = {"Connection": "close"}  # the rest of an unread body must not be taken for a next request


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, at most `max_bytes` (413 beyond, told by Content-Length or found while
    reading), within `timeout` seconds (408 for a client that stops sending)."""
    length = request.headers.get("content-length")
    chunks: list[bytes] = []

    async def receive_all() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                break
            chunks.append(chunk)
        else:
            return
        chunks.clear()
        await _discard(request.stream(), DISCARD_SECONDS)
        raise _too_large(max_bytes)

    if length is not None and length.strip().isdigit() and int(length) > max_bytes:
        if request.headers.get("expect", "").lower() != "100-continue":  # (else nothing was sent yet)
            await _discard(request.stream(), DISCARD_SECONDS)
        raise _too_large(max_bytes)
    try:
        await asyncio.wait_for(receive_all(), timeout)
    except asyncio.TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout:g} s (--request-timeout)",
            param="body",
            code="request_timeout",
            headers=_CLOSE,
        ) from None
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


async def _discard(stream: Any, seconds: float) -> None:
    """Read and drop what the client is still sending, for a bounded time, before answering 413:
    closing a socket with unread input makes the kernel reset the connection, and the client
    would see a reset instead of the answer (a "lingering close", as nginx does)."""
    try:
        await asyncio.wait_for(_drain(stream), seconds)
    except (asyncio.TimeoutError, ClientDisconnect, RuntimeError):  # RuntimeError: stream already consumed
        pass


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def _too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than {max_bytes} bytes (--max-body-bytes)",
        param="body",
        code="body_too_large",
        headers=_CLOSE,
    )


def parse_fields(raw: bytes, content_type: str, file_fields: Iterable[str] = ()) -> tuple[dict[str, Any], bool]:
    """A request body -> (its fields, typed?): JSON (the default; typed: numbers are numbers),
    multipart/form-data (what the openai client sends to /videos) or urlencoded (not typed: every
    value is text). `content_type` is the header as sent (a multipart boundary is case-sensitive,
    so it is never lower-cased). A multipart file part is an `UploadedFile` for a field named in
    `file_fields` (the route's file fields: /v1/videos `input_reference`, edits' `image`) and a 400
    naming the field otherwise; a field's parts named `field[]`, or the same file field repeated, are a
    list of them."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        return _parse_multipart(raw, content_type, frozenset(file_fields)), False
    if media == "application/x-www-form-urlencoded" and not raw.lstrip().startswith(b"{"):
        # (curl -d '{...}' without -H sends JSON labelled urlencoded: that is read as JSON)
        text = _decode(raw, "utf-8", "body")
        return {k: v[-1] for k, v in urllib.parse.parse_qs(text, keep_blank_values=True).items()}, False
    return parse_json_object(raw), True


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from UTF-8 bytes. `Infinity` / `NaN` tokens and huge numbers parse (as floats)
    so that the field they are in is named by its own validation."""
    text = _decode(raw, "utf-8-sig", "body")
    try:
        data = json.loads(text, parse_int=_parse_int)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body is not valid JSON: {e}", param="body", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply", param="body", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(
            400, f"the body must be a JSON object; got a {type(data).__name__}", param="body", code="invalid_json"
        )
    return data


def _parse_int(text: str) -> int | float:
    return int(text) if len(text.lstrip("-")) <= _MAX_INT_DIGITS else float(text)


def _decode(raw: bytes, charset: str, param: str) -> str:
    try:
        return raw.decode(charset)
    except LookupError:
        raise APIError(
            400, f"{param}: unknown charset {safe_text(charset)!r}; send UTF-8", param=param, code="invalid_encoding"
        ) from None
    except UnicodeDecodeError as e:
        raise APIError(
            400,
            f"{param}: not valid {charset} text (byte {e.start}: {e.reason}); send UTF-8",
            param=param,
            code="invalid_encoding",
        ) from None


def _parse_multipart(raw: bytes, content_type: str, file_fields: frozenset[str]) -> dict[str, Any]:
    """Starlette's form parsing (`Request.form`, python-multipart) over the body already read (bounded
    by `read_body`), with the part counts bounded (`MAX_FORM_FILES`, `MAX_FORM_FIELDS`: a body of
    thousands of parts is refused at the first one past them, not parsed whole). Runs its own event
    loop: the caller is a worker thread (`read_fields`), so a large form never holds up other requests."""
    from python_multipart.multipart import parse_options_header

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise APIError(
            400, "multipart/form-data needs a boundary parameter in Content-Type", param="body", code="invalid_body"
        )
    items = asyncio.run(_read_form(raw, boundary))
    # the form's charset (RFC 7578 4.6): a `_charset_` field, else the Content-Type's, else UTF-8
    given = dict((name, value) for name, value in items if isinstance(value, str))
    charset = given.get("_charset_") or options.get(b"charset", b"utf-8").decode("latin-1")
    if not items:
        raise APIError(
            400,
            "malformed multipart/form-data body (no parts with the boundary given)",
            param="body",
            code="invalid_body",
        )
    fields: dict[str, Any] = {}
    for raw_name, value in items:
        name = safe_text(_utf8(raw_name))
        if not name or name == "_charset_":
            continue
        if isinstance(value, str):  # a text field: its bytes (read as latin-1, so kept as sent) decoded here
            fields[name] = _decode(value.encode("latin-1"), charset, name)
            continue
        # `image[]` (the openai client's array of files) and a repeated `image` part are one list
        array = name.endswith("[]")
        name = name.removesuffix("[]")
        if name not in file_fields:
            takes = f"; this endpoint takes files as {', '.join(sorted(file_fields))}" if file_fields else ""
            raise APIError(
                400, f"{name}: a file upload is not taken here{takes}", param=name, code="unsupported_parameter"
            )
        if array or name in fields:
            before = fields.get(name)
            fields[name] = [*(before if isinstance(before, list) else [] if before is None else [before]), value]
        else:
            fields[name] = value
    return fields


async def _read_form(raw: bytes, boundary: bytes) -> list[tuple[str, str | UploadedFile]]:
    """The parts of a multipart body: (name, text read as latin-1 | `UploadedFile`), in order."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    # the request as Starlette parses it: latin-1 text keeps every byte (a field is decoded by the caller,
    # which names it when its bytes are not text); no "app" in the scope, so a malformed body raises
    # `MultiPartException` (not an HTTPException in Starlette's words)
    quoted = boundary.decode("latin-1").replace("\\", "\\\\").replace('"', '\\"')
    header = f'multipart/form-data; boundary="{quoted}"; charset=latin-1'.encode("latin-1")
    request = Request({"type": "http", "method": "POST", "headers": [(b"content-type", header)]}, receive)
    try:
        form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS, max_part_size=len(raw) + 1)
    except MultiPartException as e:
        raise APIError(400, _form_error(e.message), param="body", code="invalid_body") from None
    try:
        items: list[tuple[str, str | UploadedFile]] = []
        for name, value in form.multi_items():
            if isinstance(value, str):
                items.append((name, value))
            else:
                data = await value.read()
                kind = value.content_type or "text/plain"  # (a part without Content-Type is text/plain)
                items.append((name, UploadedFile(safe_text(_utf8(value.filename or "")), kind, data)))
        return items
    finally:
        await form.close()


def _form_error(message: str) -> str:
    """Starlette's words for a refused form, as the server words them (what to change)."""
    if message.startswith("Too many files"):
        return f"the multipart body has more than {MAX_FORM_FILES} file parts; send at most {MAX_FORM_FILES}"
    if message.startswith("Too many fields"):
        return f"the multipart body has more than {MAX_FORM_FIELDS} fields; send at most {MAX_FORM_FIELDS}"
    if message.startswith("The Content-Disposition"):
        return "malformed multipart/form-data body: a part has no name in its Content-Disposition"
    return f"malformed multipart/form-data body ({safe_text(message, 120)})"


def _utf8(text: str) -> str:
    """A name Starlette read as latin-1 -> the UTF-8 text its bytes are (a wrong byte: U+FFFD)."""
    return text.encode("latin-1", "replace").decode("utf-8", "replace")
