"""The server's limits: what one request may ask of the engine (`RequestLimits`, checked by the
engine's validation before a job is queued) and what one connection may hold (body size, time to
send a request, idle time, open connections). All are `spindle serve` options and are reported by
`GET /health` and `GET /v1/models`, as is how many finished results the job store keeps.

Torch-free (as `spindle.contracts.request`): the CLI parser reads the defaults for `spindle serve --help`."""

from __future__ import annotations

import dataclasses
import resource
from dataclasses import dataclass, field
from typing import Any

from spindle.contracts.request import RequestLimits

# Connections beyond `max_connections` that may stay open to be told 503 (or answer /health) while
# every connection has a request in flight; they come out of the 64 descriptors kept spare below.
OVERFLOW_CONNECTIONS = 16


@dataclass(frozen=True)
class ServeLimits:
    """`request`: per-request bounds (pixels, frames, steps, prompt length, outputs).
    `max_body_bytes`: a larger request body gets 413 (read no further).
    `request_timeout`: seconds a client has to send a whole request (headers and body) once it has
    started one or opened a connection; past it a half-sent request is closed (408 when the headers
    arrived).
    `keep_alive_timeout`: seconds an idle keep-alive connection stays open between requests.
    `max_connections`: open connections; at the cap a new connection closes the longest-idle one
    (no request in progress); when every connection is busy it answers its one request with 503 +
    Retry-After (`/health` as usual) and closes (at most `OVERFLOW_CONNECTIONS` such at once, past
    that it is closed unanswered). So idle sockets can never use up the file descriptors and
    `/health` keeps answering.
    `max_results`: finished jobs (results, errors, cancelled statuses) kept at once; past it the
    oldest finished ones are dropped before their `--result-ttl` (410, as an expired id). Bounds
    the memory results take when many jobs finish within the TTL."""

    request: RequestLimits = field(default_factory=RequestLimits)
    max_body_bytes: int = 1 << 20
    request_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 256
    max_results: int = 256

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024; got {self.max_body_bytes}")
        for name in ("request_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds; got {getattr(self, name)}")
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be >= 2; got {self.max_connections}")
        if self.max_results < 1:
            raise ValueError(f"max_results must be >= 1; got {self.max_results}")

    def check_file_limit(self) -> None:
        """The connection cap must fit under the process's open-file limit (with room for the
        model's files, logs, the listening socket and the `OVERFLOW_CONNECTIONS` reserve), or
        descriptors run out before the cap acts."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.max_connections > soft - 64:
            raise ValueError(
                f"--max-connections {self.max_connections} does not fit the open-file limit ({soft}, ulimit -n) "
                f"with 64 to spare: lower it to {max(2, soft - 64)} or raise the limit"
            )

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "request"}
        return {**self.request.as_dict(), **out}
