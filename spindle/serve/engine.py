"""The served model: one loaded `DiffusionGenerator` and everything the server asks of it.

`Engine` is the only object that touches the generator:
- **what it is**: its id, family, media, defaults, fps and frame rule (for `/v1/models`, `/health`,
  `seconds` -> frames);
- **what it accepts**: `validate(params)` runs the engine's own checks plus the server's request
  limits when a request arrives, before any job exists, and returns the params the job runs with
  (defaults filled, seed drawn);
- **running it**: `run(params, ...)` generates on every rank. Multi-process (`--nproc N --sp S` /
  `--cfg-parallel`): every rank loads the model; rank 0 runs HTTP and the worker; for each job it
  broadcasts the validated params (`RankFanout`, a gloo control group) and every rank runs the
  pipeline with them (the engine's SP / CFG-parallel collectives then run across the ranks).
  Cancellation is decided on rank 0 and broadcast at each `should_stop` check (before each
  denoising step and before decoding), so all ranks stop at the same step. Ranks > 0 run
  `RankFanout.follow()` until rank 0 sends "stop"; an idle rank 0 pings every minute so the
  followers' collective never times out.

The job queue and the thread that drives `run` are `worker.py`; the HTTP fields that become params
are `params.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from spindle.contracts.request import Cancelled, SamplingParams
from spindle.engine_config import RequestLimits

log = logging.getLogger("spindle.serve")

PING_SECONDS = 60.0


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


class Engine:
    """The served model (see the module docstring). `fanout`: the other ranks, when serving with
    `--nproc N` (rank 0 only); None in one process."""

    def __init__(
        self,
        generator: Any,
        model_id: str,
        root: str | None = None,
        fps: int | None = None,
        limits: RequestLimits | None = None,
        fanout: RankFanout | None = None,
    ):
        self.generator = generator
        self.limits = limits if limits is not None else RequestLimits()
        self.fanout = fanout
        self.model_id = model_id
        self.root = root
        self.spec = generator.spec
        self.media: str = self.spec.media
        self.family: str = self.spec.family
        self.defaults: SamplingParams = generator.defaults
        self.fps: int = int(fps or self.spec.fps or 16)
        # video families: valid frame counts are k * multiple + 1, as the family declares (Wan: 4)
        self.frame_multiple: int = int(self.spec.options.frame_multiple or 1)
        self._released = False

    # ---------------------------------------------------------------- what it accepts

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

    # ---------------------------------------------------------------- running it (every rank)

    def run(
        self,
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Any:
        """One generation with validated `params`, on every rank. -> the `GenerationResult`."""
        fanout, stop = self.fanout, should_stop
        if fanout is not None:
            fanout.send("run", params)

            def stop() -> bool:  # every rank stops at the same step: rank 0 decides
                return fanout.sync_flag(should_stop())

        return self.generator.run(params, progress=progress, should_stop=stop)

    @property
    def idle_ping_seconds(self) -> float | None:
        """How long the worker may wait for a job before `ping()` (None: no followers to keep alive)."""
        return PING_SECONDS if self.fanout is not None else None

    def ping(self) -> None:
        if self.fanout is not None:
            self.fanout.send("ping")

    def release_followers(self) -> None:
        """Tell the other ranks to stop following (once; nothing to do in one process)."""
        if self.fanout is not None and not self._released:
            self.fanout.send("stop")
        self._released = True
