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

LoRA adapters chosen per request (`--lora-dir`, `spindle.infer.adapters`): a request names one in
its params (`lora`, `lora_scale`) and the generator activates it before the run. Loading and
unloading change the model, so they take the same lock as a run (they wait for the running job,
never overlap it) and are broadcast to the other ranks in that order ("lora_load" / "lora_unload").
A waiting or running request holds its adapter (`hold`): it is neither evicted nor unloaded under it.

The job queue and the thread that drives `run` are `worker.py`; the HTTP fields that become params
are `params.py`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spindle.contracts.request import Cancelled, SamplingParams, ValidRequest
from spindle.contracts.sampling import sampling_schema
from spindle.engine_config import RequestLimits

if TYPE_CHECKING:
    from spindle.contracts.options import FamilyOptions
    from spindle.infer.adapters import Adapter, LoraAdapters

log = logging.getLogger("spindle.serve")

PING_SECONDS = 60.0
# The warm-up of a model with no default size (its output follows its input image: an edit model): small, so a
# start-up never waits on a megapixel generation (--warmup-size asks for another)
WARMUP_SIZE = (256, 256)
# the fewest denoising steps the warm-up tries when --warmup-steps is not given (1, then 2, ...)
MAX_WARMUP_STEPS = 4


def warmup_image(width: int, height: int) -> Any:
    """A generated conditioning image for the warm-up (a colour gradient: no file, no network)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def to_area(image: Any, area: int) -> Any:
    """A PIL image resized to about `area` pixels at its own aspect ratio (Lanczos, as diffusers' image processor
    resizes PIL images)."""
    from PIL import Image

    scale = (area / (image.width * image.height)) ** 0.5
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image if size == image.size else image.resize(size, Image.Resampling.LANCZOS)


def startup_lora(generator: Any) -> Any:
    """The LoRA the model was loaded with (`--lora FILE`, `--lora-scale`), as job responses name it; None without."""
    from pathlib import Path

    from spindle.serve.schemas import LoraChoice

    options = getattr(getattr(generator, "pipeline", None), "options", None)
    path = getattr(options, "lora", None)
    if path is None:
        return None
    return LoraChoice(
        name=Path(path).stem if Path(path).is_file() else Path(path).name,
        scale=float(getattr(options, "lora_scale", 1.0)),
    )


def output_size_params(params: SamplingParams, size: tuple[int, int], options: FamilyOptions) -> SamplingParams:
    """`params` asking for a `size` = (width, height) output, as OpenAI's `size` means it: height and width, and
    each option that sizes the output by area (`Option.output_area`, e.g. FLUX.1 Kontext's `max_area`) set to
    width x height, and each option resizing the input to a preferred resolution (`Option.resizes_input`) off
    (the input images then resized to the output's area, their aspect kept: an edit's cost follows the size
    asked, not the upload's), unless the request gives them."""
    params.width, params.height = size
    for option in options.extra:
        if option.name in params.extra:
            continue
        if option.output_area:
            params.extra[option.name] = size[0] * size[1]
        elif option.resizes_input:  # not enlarged to the model's preferred resolution: sized to the output's area
            params.extra[option.name] = False
            params.image = [to_area(image, size[0] * size[1]) for image in params.image or []] or params.image
    return params


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
        """Ranks > 0: run every job rank 0 broadcasts (a `ValidRequest`, run as it is) until "stop", and load / unload the adapters it
        does, in the same order. Returns jobs run."""
        ran = 0
        while True:
            kind, payload = self.recv()
            if kind == "stop":
                return ran
            if kind in ("lora_load", "lora_unload"):
                try:
                    if kind == "lora_load":
                        generator.adapters.load(payload[0], Path(payload[1]))
                    else:
                        generator.adapters.unload(payload, force=True)  # rank 0 checked who holds it
                except Exception:  # rank 0 answers the client; this rank keeps following
                    log.exception("rank %d: %s %s failed", self.rank, kind, payload)
                continue
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
        self.schema = sampling_schema(self.spec.options, self.family)  # its sampling schema (the bodies' fields)
        self.startup_lora = startup_lora(generator)
        self._released = False
        # a run and an adapter load / unload never overlap (both change or read the model), and the
        # fan-out's broadcasts keep one order
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- what it accepts

    def validate(self, params: SamplingParams) -> ValidRequest:
        """Defaults filled in, a seed drawn if none, the engine's checks and the server's limits run:
        -> the request a job runs (so every rank runs exactly it, unchecked). Raises `RequestError`
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

    def warmup_params(
        self, size: tuple[int, int] | None = None, frames: int = 1, steps: int | None = None
    ) -> ValidRequest:
        """The warm-up request (`spindle serve`'s --warmup-size / --warmup-frames / --warmup-steps), validated:
        the size asked, else the model's default, else (a model sized by its input image: an edit model)
        `WARMUP_SIZE`; as many generated conditioning images as the family requires (none where they are
        optional), each of the warm-up size; the output-area options set to that size (`output_size_params`);
        `steps` None: the fewest steps the checkpoint accepts (a scheduler with `shift_terminal` needs 2).
        Raises `RequestError` naming the field when the model refuses it."""
        from spindle.contracts.request import RequestError

        default_width, default_height = self.defaults.width, self.defaults.height
        if size is not None:
            width, height = size
        elif default_width is not None and default_height is not None:
            width, height = default_width, default_height
        else:
            width, height = WARMUP_SIZE
        params = output_size_params(
            SamplingParams(
                prompt="warm-up",
                num_frames=frames if self.media == "video" else None,
                seed=0,
                image=[warmup_image(width, height) for _ in range(self.spec.options.images[0])] or None,
            ),
            (width, height),
            self.spec.options,
        )
        candidates = [steps] if steps is not None else list(range(1, MAX_WARMUP_STEPS + 1))
        for count in candidates:
            params.num_inference_steps = count
            try:
                return self.generator.validate(params)
            except RequestError as e:
                if e.field != "num_inference_steps" or count == candidates[-1]:
                    raise
        raise AssertionError("unreachable: the last candidate raises")

    # ---------------------------------------------------------------- running it (every rank)

    def run(
        self,
        request: ValidRequest,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> Any:
        """One generation of a validated request (`validate`), on every rank, run as it is. -> the
        `GenerationResult`. Anything but a `ValidRequest` is a `TypeError`: a job is validated once, when it
        is submitted, and never again."""
        if not isinstance(request, ValidRequest):
            raise TypeError(f"Engine.run takes a ValidRequest (Engine.validate's); got {type(request).__name__}")
        fanout, stop = self.fanout, should_stop
        with self._lock:
            if fanout is not None:
                fanout.send("run", request)

                def stop() -> bool:  # every rank stops at the same step: rank 0 decides
                    return fanout.sync_flag(should_stop())

            return self.generator.run(request, progress=progress, should_stop=stop)

    @property
    def idle_ping_seconds(self) -> float | None:
        """How long the worker may wait for a job before `ping()` (None: no followers to keep alive)."""
        return PING_SECONDS if self.fanout is not None else None

    def ping(self) -> None:
        if self.fanout is not None:
            with self._lock:
                self.fanout.send("ping")

    # ---------------------------------------------------------------- LoRA adapters

    @property
    def adapters(self) -> LoraAdapters | None:
        """The generator's run-time adapters (None: the server was started without --lora-dir)."""
        adapters: LoraAdapters | None = getattr(self.generator, "adapters", None)
        return adapters

    def hold(self, params: SamplingParams) -> Callable[[], None]:
        """Keep the request's adapter loaded until the returned release is called (its job's end)."""
        name, adapters = params.lora, self.adapters
        if name is None or adapters is None:
            return lambda: None
        adapters.pin(name)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                adapters.unpin(name)

        return release

    def load_adapter(self, name: Any, path: str | None) -> tuple[Adapter, list[str]]:
        """Load the adapter at `path` (inside the adapter folder; default: by `name`) as `name`, on every
        rank, after the running job. -> (the adapter, the names unloaded to make room). Raises
        `AdapterError` (its HTTP status) for a refused name, path or file."""
        from spindle.infer.adapters import AdapterError

        adapters = self.adapters
        if adapters is None:
            raise AdapterError(
                "this server loads no LoRA adapters at run time: start it with --lora-dir DIR (the folder of "
                "adapters clients may load)",
                status=403,
                code="lora_loading_disabled",
            )
        name = adapters.check_name(name)
        resolved = adapters.resolve(path, name)
        with self._lock:
            planned = adapters.plan_load(name, resolved)
            if self.fanout is not None and adapters.get(name) is None:
                self.fanout.send("lora_load", (name, str(resolved)))
            adapter = adapters.load(name, resolved)  # first: a file that is refused evicts nothing
            # (one planned victim that a request named while the new one loaded stays, one over --max-loras)
            evicted = [victim for victim in planned if not adapters.in_use(victim)]
            for victim in evicted:
                self._unload(adapters, victim)
            return adapter, evicted

    def unload_adapter(self, name: str) -> Adapter:
        """Unload adapter `name` on every rank (its tensors freed), after the running job; refused
        (409) while a waiting or running request names it."""
        from spindle.infer.adapters import AdapterError

        adapters = self.adapters
        if adapters is None:
            raise AdapterError("no LoRA adapters are loaded (this server has no --lora-dir)", 404, "lora_not_found")
        with self._lock:
            return self._unload(adapters, name)

    def _unload(self, adapters: LoraAdapters, name: str) -> Adapter:
        adapter = adapters.unload(name)
        if self.fanout is not None:
            self.fanout.send("lora_unload", name)
        return adapter

    def release_followers(self) -> None:
        """Tell the other ranks to stop following (once; nothing to do in one process)."""
        if self.fanout is not None and not self._released:
            self.fanout.send("stop")
        self._released = True
