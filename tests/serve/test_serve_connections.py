"""Connections against a live server on loopback, over raw sockets where a well-behaved client
library would not misbehave: a client that hangs up cancels its image request; silent, half-sent
and idle connections are closed after their timeouts; a hang-up mid-body logs no traceback; idle
sockets at the connection cap do not stop `/health`; unparseable HTTP gets a JSON 400."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from spindle.serve import ServeLimits, build_app
from tests.serve.test_serve import KW, LiveServer, gen  # noqa: F401 - `gen`: the tiny Wan generator fixture
from tests.serve.test_serve_images import flux  # noqa: F401 - the tiny Flux generator fixture


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def connect(s: LiveServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails past `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One whole response (head and Content-Length body) on a connection that stays open."""
    sock.settimeout(timeout)
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            fields = head.lower().split(b"\r\n")
            length = next(int(f.split(b":")[1]) for f in fields if f.startswith(b"content-length:"))
            if len(body) >= length:
                return data
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk


def closed_by_server(sock: socket.socket) -> bool:
    """Has the server closed this connection (EOF or reset waiting to be read)?"""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def post_head(path: str, length: int, content_type: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def captured_logs(*names: str):
    handler = Records()
    loggers = [logging.getLogger(n) for n in names]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        for lg, level in zip(loggers, saved, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)


# ---------------------------------------------------------------------------------------------


def test_a_client_that_hangs_up_cancels_its_image_request(flux):  # noqa: F811
    generator, root = flux
    entered, release = threading.Event(), threading.Event()
    forwards = []

    def hold_first_step(module, args, kwargs):
        forwards.append(1)
        entered.set()
        assert release.wait(60), "never released"

    handle = generator.transformer.register_forward_pre_hook(hold_first_step, with_kwargs=True)
    try:
        with LiveServer(build_app(generator, model_id="tiny-flux", root=str(root))) as s:
            store = s.state.store
            body = json.dumps({"prompt": "a boat", "size": "32x32", "num_inference_steps": 50, "seed": 1}).encode()
            sock = connect(s)
            sock.sendall(post_head("/v1/images/generations", len(body)) + body)
            assert entered.wait(60), "the job never started"
            job = store.running
            assert job is not None and job.kind == "image" and not job.cancel_event.is_set()
            sock.close()  # the client gives up while step 1 of 50 runs
            # the server notices the hang-up and flags the job before the engine's next step
            wait_for(job.cancel_event.is_set, what="the hang-up to cancel the job")
            release.set()
            wait_for(lambda: job.finished, what="the job to stop")
            assert job.status == "cancelled" and job.step <= 1 and len(forwards) == 1  # 49 steps never ran
            assert store.counters["cancelled"] == 1
            # and nothing is kept: the request handler forgets the job once it sees it finished
            wait_for(lambda: store.stats()["stored"] == 0, what="the cancelled image job to be forgotten")
            # the server goes on: the next request runs to the end
            handle.remove()
            r = s.client.post(
                "/v1/images/generations", json={"prompt": "a boat", "size": "32x32", "num_inference_steps": 2}
            )
            assert r.status_code == 200 and len(r.json()["data"]) == 1
    finally:
        release.set()
        handle.remove()


@pytest.fixture(scope="module")
def quick_timeouts(gen):  # noqa: F811
    limits = ServeLimits(request_timeout=1.0, keep_alive_timeout=1.0)
    with LiveServer(build_app(gen, model_id="tiny-wan", limits=limits)) as s:
        yield s


def test_silent_and_half_sent_requests_are_closed_after_the_timeout(quick_timeouts):
    s = quick_timeouts
    silent, half_line, half_headers = connect(s), connect(s), connect(s)
    half_line.sendall(b"GET /hea")
    half_headers.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    t0 = time.monotonic()
    for sock in (silent, half_line, half_headers):
        assert read_until_closed(sock, timeout=10) == b""  # closed without an answer
        sock.close()
    assert 0.9 <= time.monotonic() - t0 < 8
    assert s.client.get("/health").status_code == 200


def test_a_half_sent_body_gets_408_and_is_closed(quick_timeouts):
    s = quick_timeouts
    sock = connect(s)
    sock.sendall(post_head("/v1/videos", 100) + b'{"prompt": ')
    status, body = status_and_json(read_until_closed(sock, timeout=10))
    sock.close()
    assert status == 408 and body["error"]["param"] == "body" and body["error"]["code"] == "request_timeout"
    assert s.state.store.counters["submitted"] == 0


def test_idle_keep_alive_connections_are_closed(quick_timeouts):
    s = quick_timeouts
    sock = connect(s)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    t0 = time.monotonic()
    response = read_until_closed(sock, timeout=10)  # the answer, then the close after 1 s idle
    sock.close()
    assert response.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in response
    assert 0.9 <= time.monotonic() - t0 < 8


def test_a_hang_up_mid_body_logs_no_traceback(quick_timeouts):
    s = quick_timeouts
    with captured_logs("uvicorn", "spindle.serve") as records:
        sock = connect(s)
        sock.sendall(post_head("/v1/videos", 1000) + b'{"prompt": "a')
        time.sleep(0.05)  # let the request reach the app before the hang-up (else h11 drops it silently)
        sock.close()
        wait_for(lambda: any("hung up" in r.getMessage() for r in records), what="the hang-up to be noticed")
        assert s.client.get("/health").status_code == 200
    assert not [r for r in records if r.levelno >= logging.WARNING or r.exc_info], [r.getMessage() for r in records]


def test_unparseable_http_gets_a_json_400(quick_timeouts):
    s = quick_timeouts
    for garbage in (b"NOT HTTP AT ALL\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"):
        sock = connect(s)
        sock.sendall(garbage)
        status, body = status_and_json(read_until_closed(sock))
        sock.close()
        assert status == 400 and body["error"]["code"] == "bad_http_request", body


def test_idle_sockets_at_the_connection_cap_do_not_stop_health(gen):  # noqa: F811
    limits = ServeLimits(max_connections=8, request_timeout=60.0, keep_alive_timeout=60.0)
    with LiveServer(build_app(gen, model_id="tiny-wan", limits=limits)) as s:
        connections = s.server.server_state.connections
        sockets = []
        try:
            for i in range(30):  # silent, half-sent and answered-then-idle connections, 30 > 8
                sock = connect(s)
                if i % 3 == 1:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                elif i % 3 == 2:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                sockets.append(sock)
            wait_for(lambda: len(connections) <= 8, timeout=10, what="the server to drop idle connections")
            t0 = time.monotonic()
            with httpx.Client(base_url=s.url, timeout=10) as fresh:
                r = fresh.get("/health")
            assert r.status_code == 200 and r.json()["limits"]["max_connections"] == 8
            assert time.monotonic() - t0 < 5
            # the oldest idle sockets were closed by the server to make room
            wait_for(lambda: sum(closed_by_server(x) for x in sockets) >= 30 - 8, timeout=10, what="closed sockets")
            # and a real request still runs to the end
            job = s.client.post("/v1/videos", json={**KW, "num_frames": 1}).json()
            assert s.wait(job["id"])["status"] == "completed"
        finally:
            for sock in sockets:
                sock.close()


def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_and_health_answers(gen):  # noqa: F811
    from spindle.serve.limits import OVERFLOW_CONNECTIONS

    limits = ServeLimits(max_connections=2, request_timeout=60.0, keep_alive_timeout=60.0)
    with LiveServer(build_app(gen, model_id="tiny-wan", limits=limits)) as s:
        connections = s.server.server_state.connections
        sockets = []
        try:
            # two requests in flight (head read, body still coming): every connection is busy
            busy = [connect(s) for _ in range(2)]
            sockets += busy
            for sock in busy:
                sock.sendall(post_head("/v1/videos", 12) + b'{"prompt": ')
            wait_for(lambda: len(connections) == 2 and not any(c.idle for c in connections), what="busy connections")
            # a request on a new connection: 503 JSON naming the limit, Retry-After, then closed
            body = json.dumps({**KW, "num_frames": 1}).encode()
            sock = connect(s)
            sockets.append(sock)
            sock.sendall(post_head("/v1/videos", len(body)) + body)
            response = read_until_closed(sock)
            status, err = status_and_json(response)
            head = response.partition(b"\r\n\r\n")[0].lower().split(b"\r\n")
            assert status == 503 and err["error"]["code"] == "too_many_connections", err
            assert "--max-connections" in err["error"]["message"]
            assert b"retry-after: 1" in head and b"connection: close" in head  # no job ran yet: the 1 s floor
            # /health still answers on a new connection (and that connection closes after it)
            sock = connect(s)
            sockets.append(sock)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, health = status_and_json(read_until_closed(sock))
            assert status == 200 and health["status"] == "ok" and health["limits"]["max_connections"] == 2
            assert s.state.store.counters["submitted"] == 0  # the refused request queued nothing
            # silent connections fill the overflow reserve; past it a new connection is closed unanswered
            silent = [connect(s) for _ in range(OVERFLOW_CONNECTIONS)]
            sockets += silent
            wait_for(lambda: len(connections) == 2 + OVERFLOW_CONNECTIONS, what="the overflow connections")
            extra = connect(s)
            sockets.append(extra)
            wait_for(lambda: closed_by_server(extra), timeout=10, what="the connection past the reserve to close")
            assert not any(closed_by_server(x) for x in silent)  # the reserve itself is left alone
            # the busy requests were never touched: their bodies end and they are answered
            for sock in busy:
                sock.sendall(b"1")  # '{"prompt": 1': not JSON
                status, err = status_and_json(read_response(sock))
                assert status == 400 and err["error"]["param"] == "body", err
        finally:
            for sock in sockets:
                sock.close()
