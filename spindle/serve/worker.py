"""The worker: runs jobs from the `JobStore` one at a time, in order, on the generator, in one
background thread (the engine is not thread-safe), and the rank fan-out for multi-process serving.

Multi-process (`--nproc N --sp S / --cfg-parallel`): every rank loads the model; rank 0 runs HTTP
and this worker; for each job it broadcasts the request (`broadcast_object_list` on a gloo control
group) and every rank runs the pipeline with it (the engine's SP / CFG-parallel collectives then
run across the ranks). Cancellation is decided on rank 0 and broadcast at each `should_stop` check
(before each denoising step and before decoding), so all ranks stop at the same step. Ranks > 0
run `follow()` until rank 0 broadcasts "stop"; an idle rank 0 sends a "ping" every minute so the
followers' collective never times out.
"""

from __future__ import annotations

import io
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from spindle.contracts.request import Cancelled, RequestError, RequestLimits, SamplingParams
from spindle.serve.jobs import Job, JobStore

log = logging.getLogger("spindle.serve")

PING_SECONDS = 60.0


class Engine:
    """What the server needs from a `DiffusionGenerator`: its media, defaults, fps, and request
    validation before a job is queued (the same checks the engine's BeforeDenoisingStage runs, plus
    the server's `limits`)."""

    def __init__(
        self,
        generator: Any,
        model_id: str,
        root: str | None = None,
        fps: int | None = None,
        limits: RequestLimits | None = None,
    ):
        self.generator = generator
        self.limits = limits if limits is not None else RequestLimits()
        self.model_id = model_id
        self.root = root
        self.spec = generator.spec
        self.media: str = self.spec.media
        self.family: str = self.spec.family
        self.defaults: SamplingParams = generator.defaults
        self.fps: int = int(fps or self.spec.fps or 16)
        # video families: valid frame counts are k * multiple + 1, as the family declares (Wan: 4)
        self.frame_multiple: int = int(self.spec.options.frame_multiple or 1)

    def validate(self, params: SamplingParams) -> SamplingParams:
        """Defaults filled in, a seed drawn if none, the engine's checks and the server's limits run:
        -> the params a job runs with (so every rank runs exactly these). Raises `RequestError`
        naming the field."""
        return self.generator.validate(params, self.limits)

    def frames_for_seconds(self, seconds: float) -> tuple[int, str | None]:
        """`seconds` -> the nearest valid frame count at the model's fps, and a note if rounded."""
        k = self.frame_multiple
        exact = seconds * self.fps
        frames = max(1, round((exact - 1) / k) * k + 1)
        note = None
        if abs(frames - exact) > 1e-9:
            note = (
                f"seconds={seconds:g} at {self.fps} fps is {exact:g} frames; this model takes {k}k+1 frames, "
                f"so num_frames={frames} ({frames / self.fps:.3g} s)"
            )
        return frames, note

    def warmup_params(self, size: tuple[int, int] | None, frames: int, steps: int) -> SamplingParams:
        width, height = size if size else (self.defaults.width, self.defaults.height)
        return SamplingParams(
            prompt="warm-up",
            height=height,
            width=width,
            num_frames=frames if self.media == "video" else None,
            num_inference_steps=steps,
            seed=0,
        )


class RankFanout:
    """Control plane between rank 0 and the other ranks: a gloo group (works beside NCCL) with a
    long timeout; rank 0 broadcasts ("run", params) / ("ping", None) / ("stop", None)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(days=1))

    def send(self, kind: str, payload: Any = None) -> None:
        assert self.rank == 0
        self.dist.broadcast_object_list([(kind, payload)], src=0, group=self.group)

    def recv(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def sync_flag(self, value: bool) -> bool:
        """Rank 0's `value` on every rank (one tiny broadcast)."""
        import torch

        t = torch.tensor([1 if value else 0], dtype=torch.int32)
        self.dist.broadcast(t, src=0, group=self.group)
        return bool(t.item())

    def follow(self, generator: Any) -> int:
        """Ranks > 0: run every job rank 0 broadcasts until "stop". Returns jobs run."""
        ran = 0
        while True:
            kind, payload = self.recv()
            if kind == "stop":
                return ran
            if kind != "run":
                continue
            ran += 1
            try:
                generator.run(payload, should_stop=lambda: self.sync_flag(False))
            except Cancelled:
                pass
            except Exception:  # rank 0 reports the failure to the client; this rank keeps following
                log.exception("rank %d: job failed", self.rank)


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

    def __init__(self, engine: Engine, store: JobStore, fanout: RankFanout | None = None, keep_frames: bool = False):
        self.engine = engine
        self.store = store
        self.fanout = fanout
        self.keep_frames = keep_frames
        self._thread: threading.Thread | None = None
        self.current: Job | None = None
        self._stopped = False

    # ---------------------------------------------------------------- lifecycle

    def warmup(self, params: SamplingParams) -> float:
        """One generation (not a job) before serving; on all ranks when fanned out. -> seconds."""
        start = time.perf_counter()
        self._generate(params, progress=None, should_stop=lambda: False)
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
        if self.fanout is not None and not self._stopped:
            self.fanout.send("stop")
        self._stopped = True

    # ---------------------------------------------------------------- running jobs

    def _loop(self) -> None:
        while True:
            job = self.store.next_job(timeout=PING_SECONDS if self.fanout else None)
            if job is None:
                if self.store.closed:
                    return
                if self.fanout is not None:
                    self.fanout.send("ping")
                continue
            self.current = job
            try:
                self._run(job)
            finally:
                self.current = None

    def _generate(
        self, params: SamplingParams, progress: Callable[[int, int], None] | None, should_stop: Callable[[], bool]
    ) -> Any:
        fanout, stop = self.fanout, should_stop
        if fanout is not None:
            fanout.send("run", params)

            def stop() -> bool:  # every rank stops at the same step: rank 0 decides
                return fanout.sync_flag(should_stop())

        return self.engine.generator.run(params, progress=progress, should_stop=stop)

    def _run(self, job: Job) -> None:
        try:
            result = self._generate(
                job.params,
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
        except RequestError as e:  # a check the engine could only make at run time
            self.store.finish(
                job,
                "failed",
                error=dict(
                    status=400, message=str(e), type="invalid_request_error", code="invalid_request", param=None
                ),
            )
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
