"""Typed sections of what a user sets to run a checkpoint rather than train one: how the engine runs it
(`EngineConfig`), what one request may ask for (`RequestLimits`), what one server connection may hold
(`ServeLimits`) and how `spindle serve` itself runs (`ServeSettings`: address, queue, results, shutdown,
warm-up). Same system as the training config (`spindle.config`): pydantic fields with their
constraints and descriptions; `spindle generate` / `spindle serve` flags and docs/cli.md are generated from
these fields (`spindle.commands.flags`), and the Python API takes the same names as keywords
(`spindle.api.load_generator(path, cache="fbc")`), rejecting a typo by naming the closest option.

Torch-free: `spindle generate --help` / `spindle serve --help` read the fields.
"""

from __future__ import annotations

import resource
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from spindle.config import OptionSection
from spindle.contracts.options import FamilyOptions
from spindle.contracts.request import RequestError, SamplingParams
from spindle.infer.caches import CacheName

if TYPE_CHECKING:
    import torch

# names of the torch dtypes an engine loads weights in (`spindle.infer.pipeline.DTYPES` maps them)
DType = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
# torch.compile backends a user may pick for `compile` (`torch._dynamo.list_backends()` names more; these are the
# two that run on every device with no extra package)
CompileBackend = Literal["inductor", "aot_eager"]

# Connections beyond `max_connections` that may stay open to be told 503 (or answer /health) while
# every connection has a request in flight; they come out of the 64 descriptors kept spare below.
OVERFLOW_CONNECTIONS = 16


class EngineConfig(OptionSection):
    """How the engine runs a checkpoint (not what it generates; that is `SamplingParams`)."""

    noun = "engine option"

    device: str | None = Field(None, description="cpu / cuda / cuda:N (default: cuda if available, else cpu)")
    dtype: DType = Field("float32", description="transformer + text encoder dtype")
    vae_dtype: DType = Field("float32", description="VAE dtype")
    exact: bool = Field(
        False,
        description="reproduce diffusers bit for bit: turn off the default speed-ups (CFG batching, per-request "
        "prompt projections, oneDNN VAE convolutions and feed-forward Linear + GELU); cannot be combined with "
        "compile or cache",
    )
    cfg_batch: bool = Field(
        True,
        description="conditional and unconditional in one batched forward (no: two forwards; off with exact)",
    )
    fast_vae: bool = Field(
        True, description="on CPU, oneDNN for the VAE's 3-D convolutions (spindle.infer.speedups; off with exact)"
    )
    fast_mlp: bool = Field(
        True,
        description="on CPU, each feed-forward's Linear + GELU as one oneDNN call (spindle.infer.speedups; off "
        "with exact or compile)",
    )
    compile: bool = Field(False, description="torch.compile the repeated transformer blocks")
    compile_backend: CompileBackend = Field(
        "inductor",
        description="torch.compile's backend for compile: inductor generates fused kernels; aot_eager traces the "
        "blocks (dynamo + AOTAutograd) and runs the traced ops as they are, to tell a tracing problem from a "
        "code-generation one, and in a fraction of inductor's compile time",
    )
    cache: CacheName | None = Field(
        None,
        description="step cache (diffusers hooks): fbc = first-block cache, mag = MagCache, taylorseer = "
        "TaylorSeer, pab = pyramid attention broadcast, faster = FasterCache; auto = calibrate on the first "
        "request and pick the fastest policy above min_psnr",
    )
    cache_threshold: float | None = Field(
        None,
        ge=0,
        description="the cache's main knob: fbc/mag threshold (higher: faster, lossier), taylorseer "
        "cache_interval, pab/faster spatial_attention_block_skip_range (default: the policy's)",
    )
    cache_options: dict[str, Any] = Field(
        default_factory=dict,
        description="more knobs of the cache's diffusers config, e.g. max_skip_steps=2",
        json_schema_extra={"flag": "--cache-option"},  # one KEY=VALUE per flag, repeatable
    )
    min_psnr: float = Field(30.0, gt=0, description="cache auto: the quality floor in dB against the uncached output")
    sp: int = Field(1, ge=1, description="Ulysses sequence-parallel degree (heads must divide it)")
    ring: int = Field(1, ge=1, description="ring-attention degree; the sequence is split over ring x sp processes")
    cfg_parallel: bool = Field(
        False, description="conditional / unconditional on different ranks (needs 2 x ring x sp processes)"
    )
    lora: str | None = Field(
        None, description="LoRA .safetensors file or folder applied to the transformer (diffusers or original layout)"
    )
    lora_scale: float = Field(1.0, description="LoRA strength")
    keep_freed_memory: bool = Field(
        True,
        description="on CPU, keep freed host memory in the process (spindle.cpu_allocator) so tensors are not "
        "page-faulted in again at every step; the output is the same (no: glibc hands it back to the OS)",
    )
    blocks_to_swap: int = Field(
        0,
        ge=0,
        description="keep the last N transformer blocks in host memory and stream them to the device with a "
        "one-block prefetch (spindle.infer.offload; for models bigger than the device; same output; 0: off)",
    )
    expert_offload: bool = Field(
        False,
        description="two-expert models (Wan2.2 A14B): each expert stays in host memory and moves to the device for "
        "the steps it denoises, so one expert is on the device at a time (same output)",
    )
    text_encoder_offload: bool = Field(
        False, description="text encoders stay on the host and visit the device only while they encode"
    )
    vae_tiling: bool = Field(
        False, description="diffusers' own tiled (and sliced) VAE decoding: VAE memory bounded by the tile"
    )

    attention_backend: str = Field(
        "native",
        description="diffusers' attention dispatcher backend of the transformer (spindle.ops.dit_attention): native "
        "(torch SDPA, the stock pipeline's; default), _native_math / _native_flash (CPU too), flash, flash_varlen, "
        "_flash_3, sage, flex, xformers, _native_cudnn (CUDA, when installed); refused up front when it cannot run",
    )

    @model_validator(mode="after")
    def _combinations(self) -> EngineConfig:
        from spindle.infer.caches import POLICIES, check_cache_options
        from spindle.ops.dit_attention import check_dit_backend

        check_dit_backend(self.attention_backend, self.torch_device().type, self.sp, self.ring)

        check_cache_options(self.cache, self.cache_threshold, self.cache_options)
        if self.exact and (self.compile or self.cache is not None):
            raise ValueError(
                "exact=True reproduces diffusers bit for bit, so it cannot be combined with "
                f"{'compile' if self.compile else 'cache=' + repr(self.cache)}; drop one of them"
            )
        policy = POLICIES.get(self.cache) if self.cache is not None else None
        reason = policy.cfg_unavailable(self.cfg_batch, self.cfg_parallel) if policy is not None else None
        if reason is not None:
            raise ValueError(reason)  # early: the denoising stage (which checks it again) does not exist yet
        if self.cache == "auto" and self.world_size_needed > 1:
            raise ValueError(
                "cache='auto' calibrates in one process; pick the policy it printed for sp / ring / cfg_parallel"
            )
        if self.blocks_to_swap and self.expert_offload:
            raise ValueError(
                "blocks_to_swap streams blocks of each expert, expert_offload whole experts; drop one of them"
            )
        if self.compile_backend != "inductor" and not self.compile:
            raise ValueError(f"compile_backend={self.compile_backend!r} applies to compile; set compile too")
        if self.blocks_to_swap and self.compile:
            # the compiled block would trace the hooks that swap its weights
            raise ValueError("blocks_to_swap cannot be combined with compile; drop one of them")
        return self

    @property
    def batch_cfg(self) -> bool:
        return self.cfg_batch and not self.exact

    @property
    def onednn_vae(self) -> bool:
        return self.fast_vae and not self.exact

    @property
    def world_size_needed(self) -> int:
        return self.sp * self.ring * (2 if self.cfg_parallel else 1)

    def torch_device(self) -> torch.device:
        import torch

        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def _zero_is_none(value: Any) -> Any:
    """A request bound of 0 means none (the command line has no None); below 0 is a mistake."""
    if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
        if value < 0:
            raise ValueError(f"must be >= 0 (0: no limit); got {value}")
        return None
    return value


# a per-request bound: a positive integer, or None / 0 for no bound
Bound = Annotated[Annotated[int, Field(ge=1)] | None, BeforeValidator(_zero_is_none)]


class RequestLimits(OptionSection):
    """Upper bounds on what one request may ask for, checked before it is queued (a server's `--max-*`
    options). They bound memory and time per job: latents and activations grow with pixels x frames, the
    run time with steps, the text encoder's input and every stored job with the prompt. None (or 0)
    disables a bound; the Python API checks none unless given limits."""

    noun = "request limit"

    max_pixels: Bound = Field(
        2048 * 2048,
        description="width x height of one image: an output, an uploaded input, or an input resized to a family's "
        "area option (image_area)",
    )
    max_frames: Bound = Field(257, description="frames of one video")
    max_steps: Bound = Field(200, description="denoising steps of one request")
    max_prompt_chars: Bound = Field(4000, description="characters of a prompt")
    max_outputs: Bound = Field(10, description="outputs of one request (prompts x num_outputs_per_prompt, n)")

    def as_dict(self) -> dict[str, int | None]:
        return self.model_dump()

    def check(self, params: SamplingParams) -> None:
        """Raise `RequestError` naming the field for a request past a limit (after the sampling schema's checks)."""
        if self.max_prompt_chars is not None:
            for name in ("prompt", "negative_prompt"):
                value = getattr(params, name)
                texts = [value] if isinstance(value, str) else list(value or [])
                longest = max((len(t) for t in texts), default=0)
                if longest > self.max_prompt_chars:
                    raise RequestError(
                        f"{name} is {longest} characters; this server takes at most {self.max_prompt_chars} "
                        "(--max-prompt-chars)",
                        field=name,
                    )
        _check_max("num_inference_steps", params.num_inference_steps, self.max_steps, "--max-steps")
        _check_max("num_outputs_per_prompt", params.batch_size, self.max_outputs, "--max-outputs")
        if params.num_frames is not None:
            _check_max("num_frames", params.num_frames, self.max_frames, "--max-frames")
        h, w = params.height, params.width
        if self.max_pixels is not None and isinstance(h, int) and isinstance(w, int) and h * w > self.max_pixels:
            raise RequestError(
                f"width x height = {w}x{h} = {w * h} pixels; this server takes at most {self.max_pixels} pixels per "
                "output (--max-pixels)",
                field="width",
            )

    def check_areas(self, params: SamplingParams, options: FamilyOptions) -> None:
        """Raise `RequestError` naming the option for a family option that is a pixel area (`Option.pixels`:
        an input image resized to it) past `max_pixels`: the bound is per image, made or read."""
        if self.max_pixels is None:
            return
        for option in options.extra:
            value = params.extra.get(option.name)
            if option.pixels and isinstance(value, int) and value > self.max_pixels:
                raise RequestError(
                    f"{option.name} is {value} pixels; this server takes at most {self.max_pixels} pixels per image "
                    f"(--max-pixels); give {option.name} <= {self.max_pixels}",
                    field=option.name,
                )


def _check_max(name: str, value: Any, maximum: int | None, option: str) -> None:
    if maximum is not None and isinstance(value, int) and not isinstance(value, bool) and value > maximum:
        raise RequestError(f"{name} is {value}; this server takes at most {maximum} ({option})", field=name)


class ServeLimits(OptionSection):
    """What one server connection may hold, and the per-request bounds (`request`). All are `spindle
    serve` options and are reported by `GET /health` and `GET /v1/models`.

    At `max_connections` a new connection closes the longest-idle one (no request in progress); when
    every connection is busy it answers its one request with 503 + Retry-After (`/health` as usual) and
    closes (at most `OVERFLOW_CONNECTIONS` such at once, past that it is closed unanswered). So idle
    sockets can never use up the file descriptors and `/health` keeps answering."""

    noun = "server limit"

    request: RequestLimits = Field(
        default_factory=RequestLimits, description="per-request bounds (pixels, frames, steps, prompt, outputs)"
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, description="request body size; 413 beyond")
    request_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a client has to send a whole request (headers and body) once it has started one or "
        "opened a connection; a half-sent one is closed (408 when the headers arrived)",
    )
    keep_alive_timeout: float = Field(
        5.0, gt=0, description="seconds an idle keep-alive connection stays open between requests"
    )
    max_connections: int = Field(
        256,
        ge=2,
        description="open connections; at the cap a new one closes the longest-idle one, or answers 503 when "
        "every connection has a request in flight",
    )
    max_results: int = Field(
        256,
        ge=1,
        description="finished jobs (results, errors, cancelled statuses) kept in memory; past it the oldest "
        "finished are dropped before --result-ttl (then 410, as expired)",
    )

    def check_file_limit(self) -> None:
        """The connection cap must fit under the process's open-file limit (with room for the model's
        files, logs, the listening socket and the `OVERFLOW_CONNECTIONS` reserve), or descriptors run out
        before the cap acts."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and self.max_connections > soft - 64:
            raise ValueError(
                f"--max-connections {self.max_connections} does not fit the open-file limit ({soft}, ulimit -n) "
                f"with 64 to spare: lower it to {max(2, soft - 64)} or raise the limit"
            )

    def as_dict(self) -> dict[str, Any]:
        return {**self.request.as_dict(), **self.model_dump(exclude={"request"})}


class ServeSettings(OptionSection):
    """How `spindle serve` runs: where it listens, its queue and results, how it shuts down and warms up."""

    noun = "serve setting"

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(30000, ge=0, le=65535, description="port (0: any free port)")
    served_model_name: str | None = Field(None, description="model id in /v1/models (default: the folder name)")
    max_queue: int = Field(16, ge=1, description="jobs that may wait; one more gets 429")
    result_ttl: float = Field(3600.0, gt=0, description="seconds a finished job's result is kept (then 410)")
    shutdown_grace: float = Field(
        30.0, ge=0, description="on SIGTERM, seconds the running job may take to finish before it is cancelled"
    )
    shutdown_linger: float = Field(
        3.0,
        ge=0,
        description="on SIGTERM, seconds job status stays readable after the last job ended (0 with no job stored)",
    )
    keep_frames: bool = Field(
        False, description="also keep each result's float32 frames (GET .../content?variant=npy; memory heavy)"
    )
    warmup: bool = Field(True, description="run one small generation before accepting requests")
    warmup_size: str | None = Field(
        None,
        description="warm-up output size WxH (default: the model's default size; 256x256 for a model whose size "
        "follows its input image); an image-conditioned model warms up on generated images of this size",
    )
    warmup_frames: int = Field(1, ge=1, description="warm-up frame count for video models")
    warmup_steps: int | None = Field(
        None, ge=1, description="warm-up denoising steps (default: the fewest the checkpoint's scheduler accepts)"
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="log level")


class AdapterConfig(OptionSection):
    """LoRA adapters a server loads at run time and a request chooses (`lora`, `lora_scale`;
    `spindle.infer.adapters`). Loading reads only from `lora_dir`: the operator decides which files a
    client may name."""

    noun = "adapter option"

    lora_dir: str | None = Field(
        None,
        description="folder of LoRA adapters (.safetensors files, or folders with pytorch_lora_weights.safetensors) "
        "that POST /v1/loras may load by name; any other path is refused (none: no loading at run time)",
    )
    max_loras: int = Field(
        4,
        ge=1,
        description="LoRA adapters kept loaded at once; loading one more unloads the least recently used one that "
        "no waiting or running request names",
    )

    @field_validator("lora_dir")
    @classmethod
    def _lora_dir_exists(cls, value: str | None) -> str | None:
        from pathlib import Path

        if value is not None and not Path(value).is_dir():
            raise ValueError(f"must be a directory (the folder holding the adapters); got {value!r}")
        return value


def check_adapter_engine(engine: EngineConfig, name: Callable[[str], str] = str) -> None:
    """Engine options that run-time adapters (`lora_dir`) cannot be combined with: a LoRA applied to every
    request, and streamed blocks (which would not carry the adapters' weights). `name` spells an option
    (a flag: `--lora`). Raises `ValueError`."""
    if engine.lora is not None:
        raise ValueError(
            f"{name('lora_dir')} cannot be combined with {name('lora')} (one LoRA for every request): put the "
            "LoRA file in the adapter folder and name it in the requests instead"
        )
    if engine.blocks_to_swap:
        raise ValueError(
            f"{name('lora_dir')} cannot be combined with {name('blocks_to_swap')}: the streamed blocks would not "
            "carry the adapters' weights; drop one of them"
        )
