"""What a generation request carries between stages: `SamplingParams` in, `Req` through the stages.

`SamplingParams` is the user-facing request (validated, filled with the family's defaults);
`Req` is the working state the stages fill in turn (SGLang-diffusion's batch object):
BeforeDenoising sets `latents`, `timesteps`, `prompt_embeds`, ...; Denoising updates `latents`;
Decoding sets `output`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # torch is imported where a Req is built: `--help` reads spindle.engine_config, which imports this
    import torch

T = TypeVar("T")
MAX_GUIDANCE = 100.0  # CFG scales in use are 1-20; far larger ones only blow the latents up


class RequestError(ValueError):
    """A request the model cannot serve; the message names the field and what is allowed.
    `field`: the request field at fault (the server's error body names it), given by every raise site."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: error messages never echo a huge input back."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


def _check_text(name: str, text: str) -> None:
    """Text must be encodable as UTF-8: a lone surrogate (JSON "\\ud800") breaks the tokenizer and
    every JSON answer that echoes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"{name} contains a lone surrogate code point; send valid Unicode text", field=name
        ) from None


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
    # conditioning images (image-to-video, image edits): PIL images, uint8 [H, W, 3] arrays or file paths;
    # how many a family takes is its `FamilyOptions.images`; `load_images` reads them into RGB PIL images
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

    def validate_common(self) -> None:
        """Checks every family shares; a family's BeforeDenoisingStage adds its own (sizes, frames)."""
        prompts = self.prompts
        if not isinstance(self.prompt, (str, list)) or not prompts:
            raise RequestError(
                "prompt is required: a non-empty string (or a non-empty list of strings)", field="prompt"
            )
        for p in prompts:
            if not isinstance(p, str) or not p.strip():
                raise RequestError(f"prompt must be a non-empty string; got {short_repr(p)}", field="prompt")
            _check_text("prompt", p)
        if self.negative_prompt is not None:
            negs = [self.negative_prompt] if isinstance(self.negative_prompt, str) else self.negative_prompt
            if not isinstance(negs, list) or not all(isinstance(n, str) for n in negs):
                raise RequestError("negative_prompt must be a string or a list of strings", field="negative_prompt")
            for n in negs:
                _check_text("negative_prompt", n)
            if not isinstance(self.negative_prompt, str) and len(negs) != len(prompts):
                raise RequestError(
                    f"negative_prompt has {len(negs)} entries but prompt has {len(prompts)}; give one per prompt "
                    "(or a single string for all)",
                    field="negative_prompt",
                )
        _check_int("num_inference_steps", self.num_inference_steps, minimum=1)
        _check_int("num_outputs_per_prompt", self.num_outputs_per_prompt, minimum=1)
        if isinstance(self.guidance_scale, bool) or not isinstance(self.guidance_scale, (int, float)):
            raise RequestError(
                f"guidance_scale must be a number (> 1 enables CFG); got {short_repr(self.guidance_scale)}",
                field="guidance_scale",
            )
        if not math.isfinite(self.guidance_scale) or self.guidance_scale > MAX_GUIDANCE:
            raise RequestError(
                f"guidance_scale must be a finite number <= {MAX_GUIDANCE:g} (past ~20 outputs saturate); "
                f"got {self.guidance_scale}",
                field="guidance_scale",
            )
        if self.guidance_scale < 0:
            raise RequestError(
                f"guidance_scale must be >= 0 (> 1 enables CFG, <= 1 disables it); got {self.guidance_scale}",
                field="guidance_scale",
            )
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:  # torch's manual_seed range
                raise RequestError(f"seed must be < 2**63; got {short_repr(self.seed)}", field="seed")


def load_image(value: Any, name: str = "image") -> Any:
    """One conditioning image -> an RGB `PIL.Image.Image`. Takes a PIL image, a uint8 numpy array
    [H, W, 3] (or [H, W] grey) or a file path; anything else, or a file that cannot be decoded, is a
    `RequestError` naming the field. Pixels are never rescaled: float arrays are refused, not rounded."""
    from pathlib import Path

    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, (str, Path)):
        try:
            with Image.open(value) as opened:
                opened.load()
                image = opened.copy()
        except FileNotFoundError:
            raise RequestError(f"{name} file {str(value)!r} does not exist", field=name) from None
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise RequestError(f"{name} file {str(value)!r} cannot be read as an image ({e})", field=name) from None
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (2, 3) or (value.ndim == 3 and value.shape[2] != 3):
            raise RequestError(
                f"{name} array must be uint8 of shape [H, W, 3] (or [H, W]); got {value.dtype} {tuple(value.shape)}",
                field=name,
            )
        image = Image.fromarray(value)
    else:
        raise RequestError(
            f"{name} must be a PIL image, a uint8 [H, W, 3] array or an image file path; got {short_repr(value)}",
            field=name,
        )
    if image.width < 1 or image.height < 1:
        raise RequestError(f"{name} is empty ({image.width}x{image.height} pixels)", field=name)
    return image if image.mode == "RGB" else image.convert("RGB")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer >= {minimum}; got {short_repr(value)}", field=name)
    if value < minimum:
        raise RequestError(f"{name} must be >= {minimum}; got {value}", field=name)


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
