"""uvicorn, hardened for `spindle serve`: connection limits uvicorn lacks, and a draining shutdown.

- `GuardedH11Protocol` (uvicorn's h11 protocol plus two rules): a connection must deliver a whole
  request head within `request_timeout` seconds of opening or of its first byte (uvicorn closes
  idle keep-alive connections itself, but not ones that never send, or send half a request line);
  and at `max_connections` open connections a new one closes the longest-idle connection (none
  in progress). When every connection has a request in flight, the new one becomes one of at most
  `OVERFLOW_CONNECTIONS` overflow connections: it answers one request, `GET /health` as usual and
  anything else 503 JSON with Retry-After (the queue's estimate), then closes; past that reserve a
  new connection is closed unanswered. The answer waits for the request (it is not written on
  connect): an answer sent before the client's request is read would be lost to the reset that
  closing a socket with unread data sends. So idle or half-sent sockets cannot use up the file
  descriptors, a client at the cap learns why and when to retry, and `/health` keeps answering.
  Protocol-level errors answer JSON like the app.
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

from spindle.serve.errors import error_body
from spindle.serve.limits import OVERFLOW_CONNECTIONS, ServeLimits


def _json_bytes(message: str, type: str, code: str) -> bytes:
    return json.dumps(error_body(message, type, None, code), ensure_ascii=True).encode()


def busy_app(app: Any, protocol: GuardedH11Protocol) -> Any:
    """The ASGI app of an overflow connection: `GET /health` goes to the app (answered with
    `Connection: close`); anything else has its body drained (bounded by the body cap and the
    request timeout) and gets 503 JSON with Retry-After; either way the connection then closes."""

    async def busy(scope: dict[str, Any], receive: Callable[[], Awaitable[dict]], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD") and scope["path"] == "/health":

            async def send_closing(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
                await send(message)

            await app(scope, receive, send_closing)
            return

        async def drain() -> None:  # read the request to its end, so closing after the answer resets nothing
            read = 0
            while read <= protocol.max_body_bytes:
                message = await receive()
                read += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body"):
                    return

        try:
            await asyncio.wait_for(drain(), protocol.request_timeout)
        except asyncio.TimeoutError:
            pass  # a slow body: answer anyway and close
        seconds = protocol.retry_after() if protocol.retry_after is not None else 1
        body = _json_bytes(
            f"the server is at its connection limit ({protocol.max_connections} open connections, "
            f"--max-connections) and every connection has a request in flight; retry after {seconds} s",
            "server_error",
            "too_many_connections",
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(seconds).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return busy


class GuardedH11Protocol(H11Protocol):
    request_timeout: float = 30.0
    max_connections: int = 256
    max_body_bytes: int = 1 << 20
    overflow_connections: int = OVERFLOW_CONNECTIONS
    # seconds a refused client should wait (the job queue's estimate); set by `guarded_protocol`
    retry_after: Callable[[], int] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._last_active = time.monotonic()
        self._request_timer: asyncio.TimerHandle | None = None
        self.overflow = False
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
        others = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedH11Protocol) and not c.transport.is_closing()
        ]
        idle = [c for c in others if c.idle and not c.overflow]
        if idle:
            min(idle, key=lambda c: c._last_active)._close()
        elif sum(c.overflow for c in others) < self.overflow_connections:
            # every connection has a request in progress: this one answers its request with 503
            # (or /health) and closes
            self.overflow = True
            self.app = busy_app(self.app, self)
        else:
            self._close()  # the overflow reserve is used up too: refuse the new connection

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (bad request line, headers too large, ...): the OpenAI error
        shape, as every other error, instead of uvicorn's plain text."""
        body = _json_bytes(msg, "invalid_request_error", "bad_http_request")
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def guarded_protocol(limits: ServeLimits, retry_after: Callable[[], int] | None = None) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, with these limits; `retry_after()`:
    the Retry-After seconds of a 503 at the connection cap."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {
            "request_timeout": limits.request_timeout,
            "max_connections": limits.max_connections,
            "max_body_bytes": limits.max_body_bytes,
            "retry_after": staticmethod(retry_after) if retry_after is not None else None,
        },
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
        http=guarded_protocol(limits, retry_after=state.store.retry_after),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # (used by call_later: a float works)
        # the drain has already answered or cancelled every request; this bounds what is left
        timeout_graceful_shutdown=5,
    )
    return DrainingServer(config, drain=state.drain)
