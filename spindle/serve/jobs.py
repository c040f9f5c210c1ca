"""The job store: a bounded FIFO queue of generation jobs with statuses, progress, cancellation and
expiry of finished results. Thread-safe; the HTTP handlers (event loop) submit and read, one worker
thread takes jobs in order (`next_job`) and reports back (`start` / `progress` / `finish`);
a route awaits a job's end with `wait_done` without blocking the event loop.

Statuses follow OpenAI's video jobs: queued -> in_progress -> completed | failed, plus cancelled
(DELETE on a queued job, or a running job whose engine stopped between denoising steps).
Finished jobs are kept `result_ttl` seconds after they finish, then dropped, and at most
`max_results` of them at once: past that the oldest finished ones are dropped early (never a queued
or running job). An id that expired or was dropped is remembered (bounded) so that it answers 410,
naming the option to raise, instead of 404.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spindle.contracts.request import SamplingParams, ValidRequest
from spindle.serve.errors import APIError, safe_text
from spindle.serve.schemas import TERMINAL_STATUSES, JobStatus

log = logging.getLogger("spindle.serve")


class QueueFull(APIError):
    def __init__(self, waiting: int, retry_after: int):
        super().__init__(
            429,
            f"the job queue is full ({waiting} jobs waiting); retry after {retry_after} s",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )
        self.retry_after = retry_after


class ShuttingDown(APIError):
    def __init__(self, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            503,
            "the server is shutting down and accepts no new jobs",
            code="shutting_down",
            type="server_error",
            headers=headers,
        )


@dataclass
class Job:
    """One generation request and its outcome. `kind`: "video" (async, /v1/videos) or "image"
    (the images endpoint waits for it). `request`: what it runs, validated when it was submitted (the worker
    runs it as it is)."""

    kind: str
    request: ValidRequest
    model: str
    id: str = ""
    status: JobStatus = "queued"
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    step: int = 0
    total_steps: int = 0
    error: dict[str, Any] | None = None  # {"status", "message", "type", "param", "code"}
    content: bytes | None = None  # mp4 (video)
    images: list[bytes] | None = None  # png per output (image)
    frames: Any = None  # float32 frames, kept only with keep_frames (exact output for evaluation)
    timings: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # size, seconds, fps, notes, ...
    cancel_event: threading.Event = field(default_factory=threading.Event)
    done_event: threading.Event = field(default_factory=threading.Event)
    _callbacks: list[Callable[[Job], None]] = field(default_factory=list)
    _cb_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'video' if self.kind == 'video' else 'img'}_{uuid.uuid4().hex}"

    @property
    def params(self) -> SamplingParams:
        """The params it runs with (a copy: the request is frozen)."""
        return self.request.params

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def progress(self) -> int:
        if self.status == "completed":
            return 100
        if self.total_steps <= 0:
            return 0
        # denoising is most of the work; keep 100 for "done, decoded and encoded"
        return min(99, int(100 * self.step / self.total_steps))

    def add_done_callback(self, fn: Callable[[Job], None]) -> None:
        """`fn(job)` once the job finishes (at once if it already has); runs on the finishing thread."""
        with self._cb_lock:
            if not self.done_event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _set_done(self) -> None:
        with self._cb_lock:
            self.done_event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # one failing waiter (e.g. a gone client) must not break the worker or the others
                log.exception("job %s: a done callback failed", self.id)


class JobStore:
    """Bounded FIFO of jobs plus the finished ones until they expire.

    `max_queue`: jobs that may wait (the running one not counted); one more -> `QueueFull` (429)
    with a Retry-After estimated from the queue ahead and the durations of recent completed jobs
    (see `retry_after`). `result_ttl`: seconds a finished job (its result, error or cancelled
    status) stays readable. `max_results`: finished jobs kept at once; one more drops the job that
    finished first (results are held in memory: this bounds them when many finish within the TTL).
    """

    def __init__(
        self,
        max_queue: int = 16,
        result_ttl: float = 3600.0,
        clock: Callable[[], float] = time.time,
        max_results: int = 256,
    ):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1; got {max_queue}")
        if result_ttl <= 0:
            raise ValueError(f"result_ttl must be > 0 seconds; got {result_ttl}")
        if max_results < 1:
            raise ValueError(f"max_results must be >= 1; got {max_results}")
        self.max_queue = max_queue
        self.result_ttl = result_ttl
        self.max_results = max_results
        self.clock = clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[str, Job] = {}
        self._queue: collections.deque[Job] = collections.deque()
        # id -> "expired" / "dropped" / "deleted", so that a gone id answers 410 saying why
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._finished: collections.OrderedDict[str, None] = collections.OrderedDict()  # stored, oldest finished first
        self._running: Job | None = None
        self._closed = False
        self._durations: collections.deque[float] = collections.deque(maxlen=20)
        self.counters: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ HTTP side

    def submit(self, job: Job) -> Job:
        with self._cond:
            self._purge_locked()
            if self._closed:
                raise ShuttingDown()
            if len(self._queue) >= self.max_queue:
                self.counters["rejected"] += 1
                raise QueueFull(len(self._queue), self._retry_after_locked())
            self._jobs[job.id] = job
            self._queue.append(job)
            self.counters["submitted"] += 1
            self._cond.notify_all()
            return job

    def get(self, job_id: str, kind: str | None = None) -> Job:
        """The job, or APIError 404 (unknown id) / 410 (finished and expired)."""
        with self._lock:
            self._purge_locked()
            job = self._jobs.get(job_id)
            if job is None or (kind is not None and job.kind != kind):
                gone = self._gone.get(job_id)
                if gone == "expired":
                    raise APIError(
                        410,
                        f"{job_id} expired: results are kept {self.result_ttl:g} s after they finish (--result-ttl)",
                        param="video_id",
                        code="expired",
                    )
                if gone == "dropped":
                    # the same answer as an expired id (410, code "expired"): the result is gone for
                    # good either way; the message says which bound dropped it
                    raise APIError(
                        410,
                        f"{job_id} expired: the server keeps at most {self.max_results} finished results and newer "
                        "jobs finished after it (raise --max-results, or fetch results sooner)",
                        param="video_id",
                        code="expired",
                    )
                if gone == "deleted":
                    raise APIError(410, f"{job_id} was deleted", param="video_id", code="deleted")
                raise APIError(404, f"no job with id {safe_text(job_id)!r}", param="video_id", code="not_found")
            return job

    def list(self, kind: str | None = None) -> list[Job]:
        with self._lock:
            self._purge_locked()
            return [j for j in self._jobs.values() if kind is None or j.kind == kind]

    def page(
        self, kind: str | None = None, *, limit: int = 20, after: str | None = None, newest_first: bool = True
    ) -> tuple[Sequence[Job], bool]:
        """One page of the stored jobs in submission order (newest first by default), starting after
        the job `after` (the previous page's last id). -> (jobs, has_more)."""
        jobs = self.list(kind)
        if newest_first:
            jobs.reverse()
        start = 0
        if after is not None:
            ids = [j.id for j in jobs]
            if after not in ids:
                raise APIError(
                    400,
                    f"after: no stored job with id {safe_text(after)!r} (expired, deleted or unknown); list from the start",
                    param="after",
                    code="invalid_cursor",
                )
            start = ids.index(after) + 1
        return jobs[start : start + limit], start + limit < len(jobs)

    def queue_position(self, job: Job) -> int | None:
        """0-based position among waiting jobs (None once it left the queue)."""
        with self._lock:
            for i, queued in enumerate(self._queue):
                if queued is job:
                    return i
            return None

    def cancel(self, job: Job) -> Job:
        """Queued: removed from the queue, cancelled at once. Running: flag set; the worker's engine
        stops between denoising steps and marks it cancelled. Finished: unchanged."""
        with self._cond:
            if job.status == "queued":
                try:
                    self._queue.remove(job)
                except ValueError:  # the worker just took it
                    pass
                else:
                    self._finish_locked(job, "cancelled")
                    return job
            if job.status in ("queued", "in_progress"):
                job.cancel_event.set()
            return job

    def delete(self, job: Job) -> None:
        """Forget a finished job now (its result is freed)."""
        with self._lock:
            if job.finished and self._jobs.pop(job.id, None) is not None:
                self._finished.pop(job.id, None)
                self._remember_gone_locked(job.id, "deleted")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "waiting": len(self._queue),
                "running": self._running.id if self._running else None,
                "max_queue": self.max_queue,
                "stored": len(self._jobs),
                "finished_stored": len(self._finished),
                **dict(self.counters),
            }

    @property
    def running(self) -> Job | None:
        return self._running

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, cancel_queued: bool = True) -> builtins.list[Job]:  # `list` is the method above
        """Stop accepting jobs; cancel the waiting ones. Returns the jobs cancelled."""
        with self._cond:
            self._closed = True
            cancelled = []
            if cancel_queued:
                while self._queue:
                    job = self._queue.popleft()
                    self._finish_locked(job, "cancelled")
                    cancelled.append(job)
            self._cond.notify_all()
            return cancelled

    # ------------------------------------------------------------------ worker side

    def next_job(self, timeout: float | None = None) -> Job | None:
        """The oldest waiting job, marked in_progress; None when closed (and nothing waits) or on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(timeout=1.0 if remaining is None else min(1.0, remaining))
                self._purge_locked()
            job = self._queue.popleft()
            job.status = "in_progress"
            job.started_at = self.clock()
            self._running = job
            return job

    def progress(self, job: Job, step: int, total: int) -> None:
        job.step, job.total_steps = step, total  # plain attribute writes: readers see either value

    def finish(self, job: Job, status: JobStatus, *, error: dict[str, Any] | None = None) -> None:
        with self._cond:
            if job.started_at is not None and status == "completed":
                # only whole runs predict the next ones: a cancelled job's time says when someone
                # gave up, a failed one's how soon it broke
                self._durations.append(self.clock() - job.started_at)
            if self._running is job:
                self._running = None
            job.error = error
            self._finish_locked(job, status)

    # ------------------------------------------------------------------ internals

    def _finish_locked(self, job: Job, status: JobStatus) -> None:
        assert status in TERMINAL_STATUSES, status
        job.status = status
        job.completed_at = self.clock()
        job.expires_at = job.completed_at + self.result_ttl
        self.counters[status] += 1
        if job.id in self._jobs:
            self._finished[job.id] = None
            while len(self._finished) > self.max_results:  # oldest finished first; never a queued or running job
                dropped, _ = self._finished.popitem(last=False)
                del self._jobs[dropped]
                self._remember_gone_locked(dropped, "dropped")
                self.counters["dropped"] += 1
        job._set_done()
        self._cond.notify_all()

    def retry_after(self) -> int:
        with self._lock:
            return self._retry_after_locked()

    def _retry_after_locked(self) -> int:
        """Seconds until the work ahead of a new request is done: the waiting jobs times the mean of
        the recent completed jobs' run times, plus what is left of the running one (1 s per job
        before any has completed). Clamped to [1, 3600]."""
        per_job = sum(self._durations) / len(self._durations) if self._durations else 1.0
        ahead = len(self._queue) * per_job
        if self._running is not None and self._running.started_at is not None:
            ahead += max(0.0, per_job - (self.clock() - self._running.started_at))
        return max(1, min(3600, math.ceil(ahead)))

    def _purge_locked(self) -> None:
        now = self.clock()
        for job_id, job in list(self._jobs.items()):
            if job.finished and job.expires_at is not None and job.expires_at <= now:
                del self._jobs[job_id]
                self._finished.pop(job_id, None)
                self._remember_gone_locked(job_id, "expired")

    def _remember_gone_locked(self, job_id: str, reason: str) -> None:
        self._gone[job_id] = reason
        while len(self._gone) > 10000:
            self._gone.popitem(last=False)


async def wait_done(job: Job, timeout: float | None = None) -> bool:
    """Await the job's end from the event loop, without blocking it (or a thread). -> finished?"""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def resolve() -> None:
        if not fut.done():
            fut.set_result(None)

    def done(_job: Job) -> None:
        loop.call_soon_threadsafe(resolve)

    job.add_done_callback(done)
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
        return True
    except asyncio.TimeoutError:
        return job.finished
