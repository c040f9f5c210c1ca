"""Python API: `DiffusionGenerator.from_pretrained(path, **engine_options).generate(prompt=..., ...)`."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spindle.contracts.images import with_last_image
from spindle.contracts.request import Req, RequestError, SamplingParams, ValidRequest
from spindle.contracts.sampling import sampling_schema
from spindle.data.media import write_image, write_video
from spindle.engine_config import EngineConfig, RequestLimits, check_adapter_engine
from spindle.export.record import trained_text_length
from spindle.infer.pipeline import InferencePipeline

if TYPE_CHECKING:
    from diffusers import ModelMixin  # Any to mypy: diffusers is not followed (pyproject [tool.mypy])

    from spindle.contracts.family import DiTFamily
    from spindle.infer.adapters import LoraAdapters
    from spindle.infer.calibrate import CacheChoice


@dataclass
class GenerationResult:
    """`frames`: float32 numpy in [0, 1], [B, F, H, W, 3] for video, [B, H, W, 3] for images (as
    diffusers' `output_type="np"`). `timings`: seconds per stage. `seed`: the seed actually used."""

    frames: np.ndarray
    media: str
    timings: dict[str, float] = field(default_factory=dict)
    seed: int | None = None
    params: SamplingParams | None = None
    fps: int = 16
    # the soundtrack of a family that makes one (LTX-2): float32 [B, channels, samples] in [-1, 1], at
    # `sample_rate` Hz; `save` muxes it into each mp4. None: silent video (or an image)
    audio: np.ndarray | None = None
    sample_rate: int | None = None

    @property
    def total_seconds(self) -> float:
        return sum(self.timings.values())

    def save(self, path: str | Path, fps: int | None = None) -> list[Path]:
        """Write mp4 (video) or png (image); a batch of B > 1 gets `_0`, `_1`, ... before the suffix."""
        path = Path(path)
        frames = self.frames
        items = [frames[i] for i in range(frames.shape[0])]
        paths = (
            [path] if len(items) == 1 else [path.with_name(f"{path.stem}_{i}{path.suffix}") for i in range(len(items))]
        )
        for i, (item, p) in enumerate(zip(items, paths, strict=True)):
            p.parent.mkdir(parents=True, exist_ok=True)
            if self.media == "video":
                if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp") and item.shape[0] == 1:
                    write_image(p, item[0])
                else:
                    audio = None if self.audio is None else self.audio[i]
                    write_video(p, item, fps or self.fps, audio=audio, sample_rate=self.sample_rate)
            else:
                write_image(p, item)
        return paths


class DiffusionGenerator:
    """Loads a diffusers pipeline folder once and generates from it.

    Engine options: the fields of `spindle.engine_config.EngineConfig` (device, dtype, exact, compile,
    cache, sp, lora, ...), given as keywords. With `cache="auto"` the first
    request calibrates (`spindle.infer.calibrate`); `cache_choice` then says what was chosen.
    """

    def __init__(self, pipeline: InferencePipeline):
        self.pipeline = pipeline
        self.spec = pipeline.spec
        self.options = self.spec.options  # the family's declared sampling options (its record's `options`)
        self.schema = sampling_schema(self.options, self.spec.family)  # their strict model (refuses a common name)
        self.defaults = pipeline.spec.default_params(pipeline.components)
        self.defaults.extra = {**self.options.defaults(), **self.defaults.extra}
        # The text length the weights were trained with, when the export (or its LoRA) records it
        # (`spindle.export.record`): the default max_sequence_length, so samples match validation.
        self.trained_text_length = trained_text_length(pipeline.root, pipeline.options.lora)
        follows = pipeline.spec.follows_trained_text_length
        if self.trained_text_length is not None and self.defaults.max_sequence_length is not None and follows:
            self.defaults.max_sequence_length = self.trained_text_length
        self.cache_choice: CacheChoice | None = None  # set once cache="auto" has calibrated
        self._calibrate_first = pipeline.options.cache == "auto"
        self.adapters: LoraAdapters | None = None  # LoRA adapters chosen per request (`enable_adapters`)

    @classmethod
    def from_pretrained(cls, path: str | Path, family: DiTFamily, **engine_options: Any) -> DiffusionGenerator:
        """Load with `family`'s inference spec (resolved by the caller: `spindle.api.load_generator`)."""
        options = EngineConfig(**engine_options)  # a bad or unknown option fails here, before any loading
        return cls(InferencePipeline.from_pretrained(path, family, options))

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def transformer(self) -> ModelMixin:
        return self.pipeline.transformer

    def enable_adapters(self, lora_dir: str | Path | None, max_loras: int | None = 4) -> LoraAdapters:
        """LoRA adapters loaded at run time from `lora_dir` (`self.adapters.load`) and chosen per request
        (`generate(..., lora=NAME, lora_scale=S)`); see `spindle.infer.adapters`."""
        from spindle.infer.adapters import LoraAdapters

        check_adapter_engine(self.pipeline.options)
        if self.pipeline.family is None:
            raise ValueError("adapters need an engine loaded from a checkpoint (DiffusionGenerator.from_pretrained)")
        self.adapters = LoraAdapters(
            self.pipeline.family, self.pipeline.components, self.spec.transformer_component, lora_dir, max_loras
        )
        return self.adapters

    def validate(self, params: SamplingParams, limits: RequestLimits | None = None) -> ValidRequest:
        """What the user gave checked by the family's schema (types, bounds, rules, images: `self.schema`), the
        defaults filled in, a seed drawn if none (by this process alone), then `limits` (a server's bounds) and
        the checks that need the loaded model (sizes, frame counts, the positional range; the sequence-parallel
        split): -> the request a run takes as it is. Raises `RequestError` naming the field. Cheap (no model runs)
        and not collective, so a server can call it on rank 0 only."""
        params = self.schema.validate(params)  # what the user gave, before the defaults
        params = self._check_adapter(params)
        params = params.merged_with(self.defaults)
        if params.seed is None:
            params.seed = random.SystemRandom().randrange(2**31)
        if limits is not None:
            limits.check(params)
            limits.check_areas(params, self.options)
        before = self.pipeline.before_denoising
        before.validate(params)
        if limits is not None and (params.height, params.width) != (None, None):
            limits.check(params)  # again: a family may size the output from its input image (edit models)
        shape = before.latent_shape(params)
        if shape is not None:  # the token count must split over the SP ranks (no-op without SP)
            req = Req(params=params, device=self.pipeline.device, raw_latent_shape=shape)
            self.pipeline.denoising.check_sequence_parallel(req)
        return ValidRequest(self.family, params)

    def _check_adapter(self, params: SamplingParams) -> SamplingParams:
        """The request's adapter checked (`lora`, `lora_scale`); one trained with a recorded text length
        makes it the request's default `max_sequence_length`, as `lora=PATH` at load does."""
        if params.lora is None and params.lora_scale is None:
            return params
        if self.adapters is None:
            field = "lora" if params.lora is not None else "lora_scale"
            raise RequestError(
                f"{field}: this engine has no LoRA adapters to choose from (serve with --lora-dir DIR and load "
                "them, or apply one to every request with --lora PATH)",
                field=field,
            )
        name, scale = self.adapters.check_request(params.lora, params.lora_scale)
        params = dataclasses.replace(params, lora=name, lora_scale=scale)
        adapter = self.adapters.get(name) if name is not None else None
        if (
            adapter is not None
            and adapter.max_text_length is not None
            and params.max_sequence_length is None
            and self.defaults.max_sequence_length is not None
        ):
            params.max_sequence_length = adapter.max_text_length
        return params

    def make_request(
        self,
        request: ValidRequest,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Req:
        """The working state of one run of a validated request (its noise seeded)."""
        params = request.params
        assert params.seed is not None  # validate() draws one when none is given
        generator = torch.Generator(device="cpu").manual_seed(params.seed)
        return Req(
            params=params, device=self.pipeline.device, generator=generator, progress=progress, should_stop=should_stop
        )

    def validated(self, request: SamplingParams | ValidRequest) -> ValidRequest:
        """A validated request as it is; params validated (a seed shared by every rank drawn first if none)."""
        if isinstance(request, ValidRequest):
            return request
        if request.seed is None:
            request = dataclasses.replace(request, seed=self._shared_seed(random.SystemRandom().randrange(2**31)))
        return self.validate(request)

    def _shared_seed(self, seed: int) -> int:
        """Multi-process: every rank must draw the same noise, so rank 0's seed is broadcast."""
        if self.pipeline.mesh is None:
            return seed
        import torch.distributed as dist

        t = torch.tensor([seed], dtype=torch.int64, device=self.pipeline.device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def generate(
        self,
        prompt: str | list[str] | None = None,
        negative_prompt: str | list[str] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        num_outputs_per_prompt: int = 1,
        max_sequence_length: int | None = None,
        image: Any = None,
        lora: str | None = None,
        lora_scale: float | None = None,
        last_image: Any = None,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        **extra: Any,
    ) -> GenerationResult:
        """Generate; `progress(step, total)` is called after each denoising step, `should_stop()` is
        checked before each step (a True raises `Cancelled`). `seed=None` draws one (reported back).
        `image`: the conditioning image(s) of an image-conditioned family (a PIL image, a uint8 array, a
        path, or a list of them); `last_image`: the last frame of a first-last-frame video family (Wan FLF2V),
        the request's second image. `lora` / `lora_scale`: one of the adapters loaded at run time
        (`enable_adapters`) and its strength (default 1); none: the model without them."""
        params = SamplingParams(
            prompt=prompt,
            negative_prompt=negative_prompt,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            seed=seed,
            num_outputs_per_prompt=num_outputs_per_prompt,
            max_sequence_length=max_sequence_length,
            image=with_last_image(image, last_image),
            lora=lora,
            lora_scale=lora_scale,
            extra=extra,
        )
        return self.run(params, progress=progress, should_stop=should_stop)

    def calibrate_cache(
        self,
        params: SamplingParams | ValidRequest,
        min_psnr: float | None = None,
        policies: tuple[str, ...] | None = None,
    ) -> CacheChoice:
        """Pick and enable the fastest step cache keeping `min_psnr` dB (default: the engine's) on `params`
        (validated once here; seed 0 if none), each trial running the same validated request."""
        from spindle.infer.calibrate import calibrate_cache

        if isinstance(params, SamplingParams):
            params = self.validate(params if params.seed is not None else dataclasses.replace(params, seed=0))
        self._calibrate_first = False  # calibration runs requests through `run` itself
        self.cache_choice = calibrate_cache(self, params, min_psnr or self.pipeline.options.min_psnr, policies)
        return self.cache_choice

    def run(
        self,
        request: SamplingParams | ValidRequest,
        progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Generate `request`: params are validated first (`validate`); a `ValidRequest` runs as it is."""
        request = self.validated(request)
        if self._calibrate_first:
            self.calibrate_cache(request)
        req = self.make_request(request, progress, should_stop)
        if self.adapters is not None:  # this request's adapter, and no other's, in every LoRA layer
            scale = req.params.lora_scale
            self.adapters.activate(req.params.lora, 1.0 if scale is None else scale)
        req = self.pipeline.run(req)
        frames = np.asarray(req.output, dtype=np.float32)
        audio = None if req.audio is None else np.asarray(req.audio, dtype=np.float32)
        return GenerationResult(
            frames=frames,
            media=self.spec.media,
            timings=dict(req.timings),
            seed=req.params.seed,
            params=req.params,
            audio=audio,
            sample_rate=req.audio_sample_rate,
        )
