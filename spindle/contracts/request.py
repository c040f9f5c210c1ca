"""What a generation request carries between stages: `SamplingParams` in, `Req` through the stages.

`SamplingParams` is the user-facing request (as given; its family's schema validates it:
`spindle.contracts.sampling`); `ValidRequest` the validated one a run takes (defaults filled, seed drawn);
`Req` is the working state the stages fill in turn (SGLang-diffusion's batch object):
BeforeDenoising sets `latents`, `timesteps`, `prompt_embeds`, ...; Denoising updates `latents`;
Decoding sets `output`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch is imported where a Req is built: `--help` reads spindle.engine_config, which imports this
    import torch

T = TypeVar("T")


class RequestError(ValueError):
    """A request the model cannot serve; the message names the field and what is allowed.
    `field`: the request field at fault (the server's error body names it), given by every raise site;
    `code`: what kind of problem (the server's error `code`)."""

    def __init__(self, message: str, field: str, code: str = "invalid_request"):
        super().__init__(message)
        self.field = field
        self.code = code  # the kind of problem, as the server's error body says it (e.g. "image_too_large")


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: error messages never echo a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


def safe_text(text: str, limit: int = 64) -> str:
    """Client text fit to echo in an error: at most `limit` characters, lone surrogates escaped
    (they cannot be encoded as UTF-8, so echoing them would break the JSON answer itself)."""
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _float32() -> torch.dtype:
    import torch

    return torch.float32


class Cancelled(RuntimeError):
    """The request's `should_stop` callback asked to stop (checked between denoising steps)."""


@dataclass
class SamplingParams:
    """One generation request. `None` fields take the family's defaults (see `merged_with`)."""

    prompt: str | list[str] | None = None
    negative_prompt: str | list[str] | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None  # None for image families
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    max_sequence_length: int | None = None
    # conditioning images (image-to-video, image edits): RGB PIL images once validated (`spindle.contracts.images`
    # reads them); how many a family takes is its `FamilyOptions.images`
    image: list[Any] | None = None
    # a LoRA adapter the engine has loaded (`spindle.infer.adapters`), by name, and its strength (default 1)
    lora: str | None = None
    lora_scale: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific knobs

    def merged_with(self, defaults: SamplingParams) -> SamplingParams:
        """A copy with every `None` field taken from `defaults`."""
        values = {}
        for f in dataclasses.fields(self):
            mine = getattr(self, f.name)
            values[f.name] = getattr(defaults, f.name) if mine is None else mine
        values["extra"] = {**defaults.extra, **self.extra}
        return SamplingParams(**values)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt or [])

    @property
    def batch_size(self) -> int:
        return len(self.prompts) * self.num_outputs_per_prompt

    @property
    def do_cfg(self) -> bool:
        """Classifier-free guidance runs when guidance_scale > 1 (as in diffusers)."""
        return self.guidance_scale is not None and self.guidance_scale > 1.0


def suggest(value: int, multiple: int, offset: int = 0) -> str:
    """The nearest allowed values (multiple * k + offset) around `value`, for error messages."""
    low = max(offset if offset else multiple, (value - offset) // multiple * multiple + offset)
    high = low + multiple if low < value else low
    return str(low) if low == high else f"{low} or {high}"


def check_multiple(name: str, value: Any, multiple: int, why: str) -> None:
    """`value` must be a positive multiple of `multiple` (image sizes: VAE factor x patch); the error
    names the field, the reason and the nearest allowed values. Families never round silently."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < multiple or value % multiple:
        hint = f"; try {suggest(value, multiple)}" if is_int else ""
        raise RequestError(
            f"{name} must be a positive multiple of {multiple} for this model ({why}) (got {short_repr(value)}){hint}",
            field=name,
        )


def check_size(params: SamplingParams, h_multiple: int, w_multiple: int, why: str) -> None:
    """height and width of a request: positive multiples of what the model takes (see `check_multiple`)."""
    check_multiple("height", params.height, h_multiple, why)
    check_multiple("width", params.width, w_multiple, why)


def check_frame_count(params: SamplingParams, multiple: int) -> None:
    """num_frames of a video request: `multiple` x k + 1 (a VAE compressing time `multiple`-fold keeps the first
    frame alone), the nearest allowed counts suggested."""
    n, k = params.num_frames, multiple
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or (n - 1) % k:
        hint = f"; try {suggest(n, k, offset=1)}" if isinstance(n, int) and not isinstance(n, bool) else ""
        raise RequestError(
            f"num_frames must be {k}k+1 (1, {k + 1}, {2 * k + 1}, {3 * k + 1}, ...) for this model's VAE "
            f"(got {n!r}){hint}",
            field="num_frames",
        )


def resolved(value: T | None, name: str) -> T:
    """A field the family's defaults fill (`merged_with`) before its stage reads it; None: no default."""
    if value is None:
        raise RequestError(
            f"{name} is required for this model (it has no default); give {name} in the request", field=name
        )
    return value


def check_int_range(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """An integer in [minimum, maximum] (no upper bound when `maximum` is None)."""
    bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise RequestError(f"{name} must be an integer {bounds}; got {short_repr(value)}", field=name)


@dataclass(frozen=True)
class ValidRequest:
    """A request the engine validated (`DiffusionGenerator.validate`): the exact params a run uses (the family's
    defaults filled in, a seed drawn, every check run). Only validation makes one, and the engine runs one as it
    is, never checking it again: the server's worker, its other ranks and `DiffusionGenerator.run` take it where
    they would otherwise validate. Frozen: `params` is a fresh copy each time it is read."""

    family: str
    frozen_params: SamplingParams = field(repr=False)

    @property
    def params(self) -> SamplingParams:
        p = self.frozen_params
        return dataclasses.replace(p, extra=dict(p.extra), image=None if p.image is None else list(p.image))


@dataclass
class Req:
    """The state that flows through the stages of one request."""

    params: SamplingParams
    device: torch.device
    # the request's noise (diffusers' `generator`): one, or one per sample (a rollout's keyed generators)
    generator: torch.Generator | list[torch.Generator] | None = None
    # set by the family's BeforeDenoisingStage
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    raw_latent_shape: tuple[int, ...] | None = None
    timesteps: torch.Tensor | None = None
    scheduler: Any = None  # a per-request copy of the checkpoint's scheduler (it is stateful)
    # in place of `scheduler.step`: `step(scheduler, noise_pred, t, i, latents) -> latents` (a Flow-GRPO rollout
    # sets its SDE recorder here so the engine's own denoising loop samples and records the trajectory)
    step: Callable[[Any, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor] | None = None
    model_dtype: torch.dtype = field(default_factory=_float32)  # the transformer's dtype (inputs are cast to it)
    # guidance, each by what it does (the request's `guidance_scale` means one or the other by family):
    do_cfg: bool = False  # classifier-free guidance runs (a cond and an uncond branch per step)
    cfg_scale: float = 1.0  # the CFG scale DenoisingStage combines the two branches with (`combine_cfg`)
    # the guidance value a guidance-distilled transformer takes as an input (its `guidance=` argument, one per
    # sample), passed by the family's `denoiser_kwargs`; None: the transformer embeds no guidance
    embedded_guidance: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific conditioning (pooled embeds, ids, ...)
    # set by DecodingStage
    output: Any = None
    # the request's soundtrack, where the family makes one (LTX-2): float32 [B, channels, samples] in [-1, 1] at
    # `audio_sample_rate` Hz (InferenceSpec.decode_audio); None for silent media
    audio: Any = None
    audio_sample_rate: int | None = None
    # bookkeeping
    timings: dict[str, float] = field(default_factory=dict)
    progress: Callable[[int, int], None] | None = None
    should_stop: Callable[[], bool] | None = None

    def check_cancelled(self) -> None:
        if self.should_stop is not None and self.should_stop():
            raise Cancelled("generation cancelled")
