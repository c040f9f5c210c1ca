"""uvicorn, hardened for `spindle serve`: connection limits uvicorn lacks, and a draining shutdown.

- `GuardedH11Protocol` (uvicorn's h11 protocol plus two rules): a connection must deliver a whole
  request head within `request_timeout` seconds of opening or of its first byte (uvicorn closes
  idle keep-alive connections itself, but not ones that never send, or send half a request line);
  and at `max_connections` open connections a new one closes the longest-idle connection (none
  in progress), or itself when all are busy. So idle or half-sent sockets cannot use up the file
  descriptors, and `/health` keeps answering. Protocol-level errors answer JSON like the app.
- `DrainingServer`: the first SIGTERM / SIGINT starts the app's drain (new work refused with
  503 JSON, job status still readable, running work finished or cancelled, a short linger so
  pollers see final statuses) and exits once it is done; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from spindle.serve.limits import ServeLimits


class GuardedH11Protocol(H11Protocol):
    request_timeout: float = 30.0
    max_connections: int = 256

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._last_active = time.monotonic()
        self._request_timer: asyncio.TimerHandle | None = None
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._last_active = time.monotonic()
        super().data_received(data)
        if self.idle:
            self._arm()  # bytes of a request whose head is not complete yet: its clock runs
        else:
            self._disarm()  # a request is being handled: the app owns its time (body deadline, work)

    @property
    def idle(self) -> bool:
        """No request in progress (none yet, head incomplete, or the last one answered)."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._request_timer is None:
            self._request_timer = self.loop.call_later(self.request_timeout, self._request_timed_out)

    def _disarm(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if self.idle:
            self._close()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> None:
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedH11Protocol) and c.idle and not c.transport.is_closing()
        ]
        if idle:
            min(idle, key=lambda c: c._last_active)._close()
        else:
            self._close()  # every connection has a request in progress: refuse the new one

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line, headers too large, ...): the OpenAI error
        shape, as every other error, instead of uvicorn's plain text."""
        body = json.dumps(
            {"error": {"message": msg, "type": "invalid_request_error", "param": None, "code": "bad_http_request"}}
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def guarded_protocol(limits: ServeLimits) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with these limits."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"request_timeout": limits.request_timeout, "max_connections": limits.max_connections},
    )


class DrainingServer(uvicorn.Server):
    """`uvicorn.Server` whose first exit signal runs `drain()` (an app coroutine) before exiting."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]] | None = None):
        super().__init__(config)
        self.drain = drain
        self.drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drain is None or self.drain_requested:
            super().handle_exit(sig, frame)  # a second signal: exit now
        else:
            self.drain_requested = True  # runs in a signal handler: the drain starts on the next tick

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain_task is None and self.drain is not None:
            self._drain_task = asyncio.create_task(self._run_drain())
        return await super().on_tick(counter)

    async def _run_drain(self) -> None:
        try:
            if self.drain is not None:
                await self.drain()
        finally:
            self.should_exit = True


def make_server(app: Any, *, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info") -> DrainingServer:
    """A `DrainingServer` for a `build_app` app, with the app's connection limits."""
    state = app.state.serve
    limits: ServeLimits = state.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # (used by call_later: a float works)
        # the drain has already answered or cancelled every request; this bounds what is left
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(config, drain=state.drain)
