"""The worker: one background thread takes jobs from the `JobStore` in order and runs each on the
`Engine` (the generator is not thread-safe: one job at a time), then stores its result (mp4 or
PNGs) or its error on the job. A job that raises fails alone; the server keeps serving.

The engine (`engine.py`) is what runs a generation, on every rank when serving multi-process.
"""

from __future__ import annotations

import io
import logging
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from spindle.contracts.request import Cancelled, RequestError, ValidRequest
from spindle.serve.engine import Engine
from spindle.serve.errors import request_error
from spindle.serve.jobs import Job, JobStore

log = logging.getLogger("spindle.serve")


def encode_video(result: Any, fps: int) -> bytes:
    with tempfile.TemporaryDirectory(prefix="spindle-serve-") as tmp:
        path = Path(tmp) / "video.mp4"
        result.save(path, fps=fps)
        return path.read_bytes()


def encode_png(frame: np.ndarray) -> bytes:
    from PIL import Image

    array = frame if frame.dtype == np.uint8 else (np.clip(frame, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


class Worker:
    """One background thread: `store.next_job()` -> engine -> result/error on the job."""

    def __init__(self, engine: Engine, store: JobStore, keep_frames: bool = False):
        self.engine = engine
        self.store = store
        self.keep_frames = keep_frames
        self._thread: threading.Thread | None = None
        self.current: Job | None = None

    # ---------------------------------------------------------------- lifecycle

    def warmup(self, request: ValidRequest) -> float:
        """One generation (not a job) before serving; on all ranks when fanned out. -> seconds."""
        start = time.perf_counter()
        self.engine.run(request)
        return time.perf_counter() - start

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="spindle-serve-worker", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, grace: float = 30.0) -> None:
        """Graceful stop: no new jobs, waiting jobs cancelled, the running job gets `grace` seconds
        to finish and is then cancelled (the engine stops at the next step); followers released."""
        self.store.close(cancel_queued=True)
        running = self.store.running
        if running is not None and not running.done_event.wait(grace):
            log.warning("shutdown: cancelling running job %s after %.0f s", running.id, grace)
            self.store.cancel(running)
        if self._thread is not None:
            self._thread.join()
        self.engine.release_followers()

    # ---------------------------------------------------------------- running jobs

    def _loop(self) -> None:
        while True:
            job = self.store.next_job(timeout=self.engine.idle_ping_seconds)
            if job is None:
                if self.store.closed:
                    return
                self.engine.ping()  # idle: the other ranks' collective must not time out
                continue
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None

    def _run(self, job: Job) -> None:
        try:
            result = self.engine.run(
                job.request,
                progress=lambda step, total: self.store.progress(job, step, total),
                should_stop=job.cancel_event.is_set,
            )
            job.timings = dict(result.timings)
            if job.kind == "video":
                start = time.perf_counter()
                job.content = encode_video(result, self.engine.fps)
                job.timings["encode"] = time.perf_counter() - start
            else:
                job.images = [encode_png(frame) for frame in result.frames]
            if self.keep_frames:
                job.frames = result.frames
            self.store.finish(job, "completed")
        except Cancelled:
            self.store.finish(job, "cancelled")
        except RequestError as e:  # a check the family's stages could only make at run time
            err = request_error(e, option_names=self.engine.spec.options.names())
            self.store.finish(job, "failed", error=err.as_job_error())
        except Exception as e:  # a failing job fails alone; the server keeps serving
            log.exception("job %s failed", job.id)
            self.store.finish(
                job,
                "failed",
                error=dict(
                    status=500,
                    message=f"generation failed: {type(e).__name__}: {e}",
                    type="server_error",
                    code="generation_failed",
                    param=None,
                ),
            )
