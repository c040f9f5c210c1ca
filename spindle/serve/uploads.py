"""Uploaded images (a multipart file part, or a base64 data URL in JSON) -> RGB PIL images, decoded
defensively: only the formats in `limits.IMAGE_FORMATS` are ever identified (Pillow's `formats=`; no
plugin that runs an external program, such as EPS's Ghostscript), and the size is read off the
header and bounded (`--max-pixels`, `MAX_IMAGE_ASPECT`) before a pixel is decoded. Every problem is
a 400 naming the request field and the limit. Callers run this in a worker thread (the routes
validate a request off the event loop): decoding never holds up the other requests."""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from spindle.contracts.request import short_repr
from spindle.serve.bodies import UploadedFile
from spindle.serve.errors import APIError, safe_text
from spindle.serve.limits import IMAGE_FORMATS, MAX_IMAGE_ASPECT

_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?(;[^,;]*?)*;base64,", re.IGNORECASE)
IMAGE_TYPES = tuple(IMAGE_FORMATS.values())
_LOOSE_TYPES = ("application/octet-stream", "text/plain")  # what clients label any file with


def decode_image(value: Any, param: str, max_pixels: int | None) -> Any:
    """An uploaded image -> an RGB PIL image. A 400 naming `param` for: not a file / data URL, a type
    that is not one of `IMAGE_TYPES`, bytes that are no image of those formats, a header size past
    `max_pixels` or `MAX_IMAGE_ASPECT` (refused before decoding), or bytes that do not decode."""
    data = _image_bytes(value, param)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS)) as opened:
            check_image_size(opened.size, param, max_pixels)
            opened.load()
            return opened.convert("RGB")
    except APIError:
        raise
    except Image.DecompressionBombError:  # (Pillow's own bound, far above any --max-pixels: read off the header)
        raise _bad(
            param, f"the image is larger than this server takes (--max-pixels {max_pixels})", "image_too_large"
        ) from None
    except UnidentifiedImageError:
        raise _bad(param, f"the image cannot be decoded (not a {', '.join(IMAGE_FORMATS)} image)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise _bad(param, f"the image cannot be decoded ({safe_text(str(e), 200)})") from None


def check_image_size(size: tuple[int, int], param: str, max_pixels: int | None) -> None:
    """An image's header size within the server's bounds: sides >= 1, at most `max_pixels` pixels and
    at most `MAX_IMAGE_ASPECT` times as long as wide."""
    width, height = size
    if width < 1 or height < 1:
        raise _bad(param, f"the image is {width}x{height} pixels; it must have a positive width and height")
    if max_pixels is not None and width * height > max_pixels:
        raise _bad(
            param,
            f"the image is {width}x{height} = {width * height} pixels; this server takes at most {max_pixels} "
            "(--max-pixels)",
            "image_too_large",
        )
    if max(width, height) > MAX_IMAGE_ASPECT * min(width, height):
        raise _bad(
            param,
            f"the image is {width}x{height} pixels, {max(width, height) / min(width, height):.0f} times as "
            f"{'wide as tall' if width > height else 'tall as wide'}; this server takes at most {MAX_IMAGE_ASPECT} "
            "times (crop or pad it)",
            "image_aspect_too_large",
        )


def _image_bytes(value: Any, param: str) -> bytes:
    """The bytes of an upload or a base64 data URL, after its declared type is checked."""
    if isinstance(value, UploadedFile):
        kind = value.content_type.lower()
        # clients label files loosely (octet-stream); a type that names something else is refused
        if kind not in IMAGE_TYPES and kind not in _LOOSE_TYPES:
            raise _bad(
                param, f"the file is {safe_text(kind)}, not an image ({', '.join(IMAGE_TYPES)})", "invalid_image_type"
            )
        return value.data
    if isinstance(value, str):
        m = _DATA_URL.match(value)
        if m is None:
            raise _bad(
                param,
                "must be an uploaded image file (multipart) or a base64 data URL like 'data:image/png;base64,...'; "
                f"got {short_repr(value, 60)} (URLs are not fetched)",
            )
        kind = (m.group(1) or "image/png").lower()
        if kind not in IMAGE_TYPES:
            raise _bad(
                param,
                f"the data URL is {safe_text(kind)}, not an image ({', '.join(IMAGE_TYPES)})",
                "invalid_image_type",
            )
        try:
            return base64.b64decode(value[m.end() :], validate=True)
        except (binascii.Error, ValueError):
            raise _bad(param, "the data URL's base64 does not decode") from None
    raise _bad(param, f"must be an uploaded image file or a base64 data URL; got {short_repr(value, 60)}")


def _bad(param: str, message: str, code: str = "invalid_image") -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)
