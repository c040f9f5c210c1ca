"""The server's limits: what one request may ask of the engine (`RequestLimits`, checked by the
engine's validation before a job is queued) and what one connection may hold (body size, time to
send a request, idle time, open connections, finished results kept). They are typed sections of
`spindle.engine_config`, where `spindle serve`'s flags come from; this module names them for the server,
with the fixed bounds on what a body may hold (form parts, uploaded images)."""

from __future__ import annotations

from spindle.contracts.images import IMAGE_FORMATS, MAX_IMAGE_ASPECT
from spindle.engine_config import OVERFLOW_CONNECTIONS, RequestLimits, ServeLimits

# parts of one multipart body: a generation form has a few dozen fields and at most a few images; a
# body past these is refused at the first part over (not parsed whole), whatever its size
MAX_FORM_FILES = 16
MAX_FORM_FIELDS = 128
# what an uploaded image may be (`IMAGE_FORMATS`) and how elongated (`MAX_IMAGE_ASPECT`): `spindle.contracts.images`

__all__ = [
    "IMAGE_FORMATS",
    "MAX_FORM_FIELDS",
    "MAX_FORM_FILES",
    "MAX_IMAGE_ASPECT",
    "OVERFLOW_CONNECTIONS",
    "RequestLimits",
    "ServeLimits",
]
