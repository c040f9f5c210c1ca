"""The server's limits: what one request may ask of the engine (`RequestLimits`, checked by the
engine's validation before a job is queued) and what one connection may hold (body size, time to
send a request, idle time, open connections, finished results kept). They are typed sections of
`spindle.engine_config`, where `spindle serve`'s flags come from; this module names them for the server."""

from __future__ import annotations

from spindle.engine_config import OVERFLOW_CONNECTIONS, RequestLimits, ServeLimits

__all__ = ["OVERFLOW_CONNECTIONS", "RequestLimits", "ServeLimits"]
