"""The one home of a request's input images (`image`, a first-last-frame model's `last_image`, an edit's list of
images), for the Python API, `spindle generate` and the server alike:

- `load_image`: one image given in Python or on the command line (a PIL image, a uint8 array, a file path) -> RGB;
- `decode_upload`: one image sent over HTTP (a multipart `UploadedFile` or a base64 data URL) -> RGB, decoded
  defensively (only `IMAGE_FORMATS`, the size read off the header and bounded before a pixel is decoded);
- `with_last_image`: the request's images with the last frame appended (the field names are the caller's:
  `last_image`, `--last-image`);
- `count_images`: the images counted against what the family takes (`FamilyOptions.images`);
- `request_images`: the three above in one order (the sampling schema's and `spindle generate`'s, which only
  reads the files' headers before any weight loads); `open_image_file`: an image file read (or its header).

Every problem is a `RequestError` naming the field (its `code` says which kind, for the server's answer).
Light: PIL and numpy are imported when an image is read (the CLI parser imports this module's users)."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass, field
from typing import Any

from spindle.contracts.request import RequestError, safe_text, short_repr

# what an uploaded image may be. Only these decoders are ever run (Pillow's `formats=`): no format
# whose plugin calls an external program (EPS runs Ghostscript) or that no client sends as a photo
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "BMP": "image/bmp", "GIF": "image/gif"}
IMAGE_TYPES = tuple(IMAGE_FORMATS.values())
# longer side / shorter side of an uploaded image, read off its header before decoding: the
# vision-language processors the editing families encode inputs with refuse 200 and more
# (Qwen2-VL's `smart_resize`), and a 524288x8 strip costs hundreds of MB to resize for no use
MAX_IMAGE_ASPECT = 200
_LOOSE_TYPES = ("application/octet-stream", "text/plain")  # what clients label any file with
_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?(;[^,;]*?)*;base64,", re.IGNORECASE)


@dataclass(frozen=True)
class UploadedFile:
    """A file part of a multipart body (a form field the route declares as a file, e.g. `input_reference`)."""

    filename: str
    content_type: str
    data: bytes = field(repr=False)

    def __repr__(self) -> str:  # what a validation error echoes: never the bytes
        return f"<file {self.filename!r} ({self.content_type}, {len(self.data)} bytes)>"


def load_image(value: Any, name: str = "image") -> Any:
    """One conditioning image -> an RGB `PIL.Image.Image`. Takes a PIL image, a uint8 numpy array
    [H, W, 3] (or [H, W] grey) or a file path; anything else, or a file that cannot be decoded, is a
    `RequestError` naming the field. Pixels are never rescaled: float arrays are refused, not rounded."""
    from pathlib import Path

    import numpy as np
    from PIL import Image

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (str, Path)):
        image = open_image_file(value, name)
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] != 3):
            raise RequestError(
                f"{name} array must be uint8 of shape [H, W, 3] (or [H, W]); got {value.dtype} {tuple(value.shape)}",
                field=name,
            )
        image = Image.fromarray(value)
    else:
        raise RequestError(
            f"{name} must be a PIL image, a uint8 [H, W, 3] array or an image file path; got {short_repr(value)}",
            field=name,
        )
    if image.width < 1 or image.height < 1:
        raise RequestError(f"{name} is empty ({image.width}x{image.height} pixels)", field=name)
    return image if image.mode == "RGB" else image.convert("RGB")


def open_image_file(path: Any, name: str = "image", decode: bool = True) -> Any:
    """The image file at `path` -> a decoded `PIL.Image.Image` (`decode=False`: only its header read, to check a
    file before any weight loads; None). A `RequestError` naming `name` (the field or flag, e.g. `--image`) for a
    file that does not exist or is no image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as opened:
            if not decode:
                return None
            opened.load()
            return opened.copy()
    except FileNotFoundError:
        raise RequestError(f"{name} file {str(path)!r} does not exist", field=name) from None
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise RequestError(f"{name} file {str(path)!r} cannot be read as an image ({e})", field=name) from None


def as_list(images: Any) -> list[Any] | None:
    """A request's `image`: None, one image given bare, or a list / tuple of them -> a list (None: none)."""
    if images is None:
        return None
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    return items or None


def with_last_image(
    images: Any, last_image: Any, *, image_name: str = "image", last_name: str = "last_image", first: str = ""
) -> list[Any] | None:
    """The request's images with a first-last-frame model's last frame appended (its second image): `last_image`
    goes with exactly one image, the first frame; the error names the fields as the caller spells them (`first`:
    how it says the one image, default "exactly one IMAGE_NAME")."""
    items = as_list(images)
    if last_image is None:
        return items
    if items is None or len(items) != 1:
        first = first or f"exactly one {image_name}"
        raise RequestError(f"{last_name} goes with {first} (the first frame)", field="last_image")
    return [*items, last_image]


def count_images(
    images: list[Any] | None, bounds: tuple[int, int], family: str, *, name: str = "image", how: str = ""
) -> None:
    """The request's images counted against `bounds` = (fewest, most) the family takes; a `RequestError`
    (field `image`) otherwise. The one count rule of the engine, the server (through the engine) and
    `spindle generate`, which names the flag (`name`: how the caller spells the field, `--image`; `how`: how to
    give one, appended when one is missing)."""
    low, high = bounds
    if not images:
        if low:
            raise RequestError(
                f"{name} is required for {family}: give {low} conditioning image(s){' ' + how if how else ''}",
                field="image",
            )
        return
    if not high:
        raise RequestError(f"{name} is not taken by {family} (it generates from text alone); drop it", field="image")
    if not low <= len(images) <= high:
        want = str(low) if low == high else f"{low} to {high}"
        raise RequestError(
            f"{name}: {family} takes {want} conditioning image(s); got {len(images)}",
            field="image",
            code="too_many_images" if len(images) > high else "invalid_request",
        )


def request_images(
    image: Any,
    last_image: Any,
    bounds: tuple[int, int],
    family: str,
    *,
    names: tuple[str, str] = ("image", "last_image"),
    how: str = "",
    decode: bool = True,
) -> list[Any] | None:
    """A request's input images as the family takes them, in one order for every caller: `last_image` appended
    (`with_last_image`), counted against `bounds` (`count_images`), then each read (`load_image` -> RGB PIL). With
    `decode=False` only the headers of the ones given as file paths are read and the items come back as given:
    what `spindle generate` checks before any weight loads. `names`: how the caller spells (image, last_image)
    (`--image`, `--last-image`), `how`: how to give a missing image; every error names them."""
    from pathlib import Path

    image_name, last_name = names
    items = with_last_image(image, last_image, image_name=image_name, last_name=last_name)
    count_images(items, bounds, family, name=image_name, how=how)
    if items is None:
        return None
    labels = [image_name] * len(items) if last_image is None else [image_name, last_name]
    if decode:
        return [load_image(item, label) for item, label in zip(items, labels, strict=True)]
    for item, label in zip(items, labels, strict=True):
        if isinstance(item, (str, Path)):
            open_image_file(item, label, decode=False)
    return items


def decode_upload(value: Any, name: str, max_pixels: int | None) -> Any:
    """An uploaded image -> an RGB PIL image. A `RequestError` naming `name` for: not a file / data URL, a type
    that is not one of `IMAGE_TYPES`, bytes that are no image of those formats, a header size past
    `max_pixels` or `MAX_IMAGE_ASPECT` (refused before decoding), or bytes that do not decode."""
    data = _upload_bytes(value, name)
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS)) as opened:
            check_image_size(opened.size, name, max_pixels)
            opened.load()
            return opened.convert("RGB")
    except RequestError:
        raise
    except Image.DecompressionBombError:  # (Pillow's own bound, far above any --max-pixels: read off the header)
        raise _bad(
            name, f"the image is larger than this server takes (--max-pixels {max_pixels})", "image_too_large"
        ) from None
    except UnidentifiedImageError:
        raise _bad(name, f"the image cannot be decoded (not a {', '.join(IMAGE_FORMATS)} image)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise _bad(name, f"the image cannot be decoded ({safe_text(str(e), 200)})") from None


def check_image_size(size: tuple[int, int], name: str, max_pixels: int | None) -> None:
    """An image's header size within the server's bounds: sides >= 1, at most `max_pixels` pixels and
    at most `MAX_IMAGE_ASPECT` times as long as wide."""
    width, height = size
    if width < 1 or height < 1:
        raise _bad(name, f"the image is {width}x{height} pixels; it must have a positive width and height")
    if max_pixels is not None and width * height > max_pixels:
        raise _bad(
            name,
            f"the image is {width}x{height} = {width * height} pixels; this server takes at most {max_pixels} "
            "(--max-pixels)",
            "image_too_large",
        )
    if max(width, height) > MAX_IMAGE_ASPECT * min(width, height):
        raise _bad(
            name,
            f"the image is {width}x{height} pixels, {max(width, height) / min(width, height):.0f} times as "
            f"{'wide as tall' if width > height else 'tall as wide'}; this server takes at most {MAX_IMAGE_ASPECT} "
            "times (crop or pad it)",
            "image_aspect_too_large",
        )


def _upload_bytes(value: Any, name: str) -> bytes:
    """The bytes of an upload or a base64 data URL, after its declared type is checked."""
    if isinstance(value, UploadedFile):
        kind = value.content_type.lower()
        # clients label files loosely (octet-stream); a type that names something else is refused
        if kind not in IMAGE_TYPES and kind not in _LOOSE_TYPES:
            raise _bad(
                name, f"the file is {safe_text(kind)}, not an image ({', '.join(IMAGE_TYPES)})", "invalid_image_type"
            )
        return value.data
    if isinstance(value, str):
        m = _DATA_URL.match(value)
        if m is None:
            raise _bad(
                name,
                "must be an uploaded image file (multipart) or a base64 data URL like 'data:image/png;base64,...'; "
                f"got {short_repr(value, 60)} (URLs are not fetched)",
            )
        kind = (m.group(1) or "image/png").lower()
        if kind not in IMAGE_TYPES:
            raise _bad(
                name,
                f"the data URL is {safe_text(kind)}, not an image ({', '.join(IMAGE_TYPES)})",
                "invalid_image_type",
            )
        try:
            return base64.b64decode(value[m.end() :], validate=True)
        except (binascii.Error, ValueError):
            raise _bad(name, "the data URL's base64 does not decode") from None
    raise _bad(name, f"must be an uploaded image file or a base64 data URL; got {short_repr(value, 60)}")


def _bad(name: str, message: str, code: str = "invalid_image") -> RequestError:
    return RequestError(f"{name}: {message}", field=name, code=code)
