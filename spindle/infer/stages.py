"""Stages of the inference engine and the callbacks a family gives the shared ones.

Request flow (SGLang-diffusion's hybrid style):

    family BeforeDenoisingStage  ->  DenoisingStage (shared)  ->  DecodingStage (shared)

The shared stages never branch on the family. Whatever differs between families goes through an
`InferenceSpec` (one per family, in `spindle/models/<family>/pipeline.py`):

- `denoiser_kwargs(req, latents, t, branch)`: the transformer's forward kwargs for one step and one
  CFG branch ("cond" / "uncond"); extra conditioning (pooled embeddings, image ids, embedded
  guidance) comes from `req.extra`.
- `batch_cfg_kwargs(cond, uncond)`: how the two branches become one forward (default: concatenate
  every per-sample tensor along the batch, keep shared tensors such as position ids once).
- `post_denoising(latents, req)`: e.g. unpack packed latents back to the VAE layout.
- `decode_scale_shift(vae, latents)`: `(scale, shift)` with `vae_input = latents / scale + shift`.
- `postprocess(decoded, req)`: VAE output -> float32 numpy in [0, 1] (diffusers' `output_type="np"`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from spindle.infer.caches import POLICIES, StepCache
from spindle.infer.request import Req, RequestError, SamplingParams

if TYPE_CHECKING:
    import torch.distributed as dist
    from diffusers import ModelMixin  # Any to mypy: diffusers is not followed (pyproject [tool.mypy])

    from spindle.infer.options import FamilyOptions


class Stage:
    """One step of the pipeline: `forward(req) -> req`. `name` keys the per-stage timing."""

    name: ClassVar[str] = "stage"

    def forward(self, req: Req) -> Req:
        raise NotImplementedError

    def __call__(self, req: Req) -> Req:
        with torch.no_grad():
            return self.forward(req)


class BeforeDenoisingStage(Stage):
    """Model-specific pre-processing: validate, encode prompt(s), prepare latents and timesteps.

    A subclass is built with the loaded components (`components[name]` as named in model_index.json)
    and must leave on the Req every field DenoisingStage reads: `latents`, `timesteps`, `scheduler`,
    `prompt_embeds` (+ `negative_prompt_embeds` when `do_cfg`), `guidance_scale`, `model_dtype`,
    `raw_latent_shape`, plus whatever its spec's `denoiser_kwargs` needs in `req.extra`.
    """

    name = "before_denoising"

    def __init__(self, components: dict[str, Any], spec: InferenceSpec):
        self.components = components
        self.spec = spec

    def validate(self, params: SamplingParams) -> None:
        """Raise `RequestError` for requests this model cannot serve (no silent rounding)."""
        params.validate_common()

    def latent_shape(self, params: SamplingParams) -> tuple[int, ...] | None:
        """The `raw_latent_shape` `forward` makes for these (validated) params, or None when unknown.
        Lets the checks that depend on it (the sequence-parallel split) run before a job is queued."""
        return None


class InferenceSpec:
    """What a family plugs into the shared engine. Subclass per family; override the callbacks."""

    family: str = ""
    media: str = "video"  # "video" (frames axis) or "image"
    # the transformer output's layout in diffusers' FasterCache terms ("BCFHW", "BFCHW", "BCHW"); None when
    # it is packed tokens [B, S, C] (Flux, Qwen-Image): FasterCache's 2-D frequency split cannot apply
    output_layout: str | None = "BCFHW"
    components: tuple[str, ...] = ()  # model_index.json entries to load
    transformer_component: str = "transformer"
    vae_component: str = "vae"
    before_denoising_cls: type[BeforeDenoisingStage] = BeforeDenoisingStage

    @property
    def options(self) -> FamilyOptions:
        """The family's declared sampling options (on its registered `FAMILY`)."""
        from spindle.models.family import DiTFamily
        from spindle.registry import get_family

        family = get_family(self.family)
        if not isinstance(family, DiTFamily):
            raise TypeError(f"family {self.family!r} is not a DiT family; it has no inference sampling options")
        options: FamilyOptions = family.options
        return options

    @property
    def fps(self) -> int | None:
        """Native frame rate of a video family (mp4 writing, seconds -> frames), as declared."""
        return self.options.fps

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        return SamplingParams()

    def check_checkpoint(self, model_index: dict[str, Any]) -> None:
        """Raise for checkpoint variants of the family this spec cannot serve."""

    def make_before_denoising(self, components: dict[str, Any]) -> BeforeDenoisingStage:
        return self.before_denoising_cls(components, self)

    # --- DenoisingStage callbacks
    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        raise NotImplementedError

    def batch_cfg_kwargs(self, cond: dict[str, Any], uncond: dict[str, Any], batch_size: int) -> dict[str, Any]:
        """Merge the two branches into one forward: per-sample tensors (leading dim == batch_size) are
        concatenated [cond; uncond]; anything else must be identical in both and is passed once."""
        merged: dict[str, Any] = {}
        for key in cond.keys() | uncond.keys():
            a, b = cond.get(key), uncond.get(key)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.ndim >= 1 and a.shape[0] == batch_size:
                if a.shape != b.shape:
                    raise ValueError(
                        f"cannot batch CFG: {key!r} has shape {tuple(a.shape)} (cond) vs {tuple(b.shape)} (uncond)"
                    )
                merged[key] = torch.cat([a, b], dim=0)
            elif (
                a is b
                or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
                or (not isinstance(a, torch.Tensor) and a == b)
            ):
                merged[key] = a
            else:
                raise ValueError(f"cannot batch CFG: {key!r} differs between cond and uncond and is not per-sample")
        return merged

    def prepare_sequence_parallel(self, req: Req, degree: int) -> None:
        """Before a `degree`-way SP run: make every sequence the transformer's plan splits divisible by
        `degree` where the family can do so exactly (Qwen-Image pads its masked text). Default: nothing."""

    def request_constant_modules(self, transformer: torch.nn.Module, compiled: bool) -> list[torch.nn.Module]:
        """Transformer submodules whose input is the same at every step of a request (a function of the
        prompt only): the engine computes them once per request (`speedups.memoize_constant_inputs`).
        `compiled`: the repeated blocks are torch.compiled, so leave modules inside them alone."""
        return []

    def linear_gelu_pairs(self, transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
        """(owner, linear attribute, GELU attribute) where a block applies a Linear then a separate GELU
        module (`speedups.onednn_linear_gelu` fuses them; diffusers' `GELU` modules are found without
        this). Default: none."""
        return []

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int | None:
        """Tokens the transformer sees for this request (checked against the SP degree); None: unknown."""
        return None

    def model_output(self, out: Any) -> torch.Tensor:
        sample: torch.Tensor = out[0] if isinstance(out, (tuple, list)) else out.sample
        return sample

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        return uncond + guidance_scale * (cond - uncond)

    # --- DecodingStage callbacks
    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        return latents

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[Any, Any]:
        cfg = vae.config
        return getattr(cfg, "scaling_factor", 1.0), getattr(cfg, "shift_factor", None) or 0.0

    def postprocess(self, decoded: torch.Tensor, req: Req) -> np.ndarray:
        """VAE output in [-1, 1] -> float32 numpy in [0, 1]: [B, F, H, W, 3] (video) or [B, H, W, 3]."""
        if decoded.ndim == 5:
            from diffusers.video_processor import VideoProcessor

            video: np.ndarray = VideoProcessor().postprocess_video(decoded, output_type="np")
            return video
        from diffusers.image_processor import VaeImageProcessor

        image: np.ndarray = VaeImageProcessor().postprocess(decoded, output_type="np")
        return image


class StageContractError(RuntimeError):
    """A family's stage or callback broke the contract of the shared stages (a bug in the family,
    not in the request): the message names the family, the stage and the `Req` field."""


def _contract(spec: InferenceSpec, where: str, field: str, problem: str) -> StageContractError:
    family = spec.family or type(spec).__name__
    return StageContractError(f"family {family!r}: {where} left Req.{field} {problem}")


def _batch_tensor(req: Req, spec: InferenceSpec, field: str, value: Any, batch: int, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise _contract(spec, where, field, f"as {type(value).__name__}; DenoisingStage needs a tensor")
    if value.ndim < 2 or value.shape[0] != batch:
        raise _contract(
            spec, where, field, f"with shape {tuple(value.shape)}; DenoisingStage needs [batch={batch}, ...]"
        )


def check_denoising_inputs(req: Req, spec: InferenceSpec) -> None:
    """What DenoisingStage reads, as the family's BeforeDenoisingStage must leave it (StageContractError
    naming the family and the field otherwise): float latents of the request's batch size, a non-empty
    1-D `timesteps`, a scheduler with `step`, prompt embeddings (and negative ones under CFG) per
    sample, a numeric `guidance_scale`, `raw_latent_shape` with the same batch size."""
    where = f"{spec.before_denoising_cls.__name__}"
    batch = req.params.batch_size
    latents = req.latents
    _batch_tensor(req, spec, "latents", latents, batch, where)
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        raise _contract(spec, where, "latents", f"as {getattr(latents, 'dtype', latents)}; DenoisingStage needs floats")
    steps = req.timesteps
    if not isinstance(steps, torch.Tensor) or steps.ndim != 1 or len(steps) == 0:
        raise _contract(spec, where, "timesteps", f"as {steps!r:.80}; DenoisingStage needs a non-empty 1-D tensor")
    if not callable(getattr(req.scheduler, "step", None)):
        raise _contract(spec, where, "scheduler", f"as {type(req.scheduler).__name__}; it needs a scheduler.step")
    _batch_tensor(req, spec, "prompt_embeds", req.prompt_embeds, batch, where)
    if req.do_cfg:
        _batch_tensor(req, spec, "negative_prompt_embeds", req.negative_prompt_embeds, batch, where + " (CFG on)")
    if isinstance(req.guidance_scale, bool) or not isinstance(req.guidance_scale, (int, float)):
        raise _contract(spec, where, "guidance_scale", f"as {req.guidance_scale!r}; DenoisingStage needs a number")
    shape = req.raw_latent_shape
    if not isinstance(shape, tuple) or not shape or shape[0] != batch:
        raise _contract(spec, where, "raw_latent_shape", f"as {shape!r}; DecodingStage needs (batch={batch}, ...)")


class DenoisingStage(Stage):
    """The shared sampling loop: transformer forward(s), CFG, scheduler step, progress/cancel.

    Options:
    - `cfg_batch`: conditional and unconditional branches in one forward (batch 2B).
    - `cfg_group`: a process group of 2 ranks; rank 0 computes cond, rank 1 uncond, the noise
      predictions are all-gathered (CFG parallel). Every rank ends with the same latents.
    - `set_cache(name, threshold, options)`: a step cache (`spindle.infer.caches.StepCache`, diffusers'
      hooks on the transformer); this stage names each call with `cache_context`, tells the hooks the
      current timestep and resets their state per request, so requests never see each other's cache.
    """

    name = "denoising"

    def __init__(
        self,
        transformer: ModelMixin,
        spec: InferenceSpec,
        cfg_batch: bool = True,
        cfg_group: dist.ProcessGroup | None = None,
        sp: int = 1,
        ring: int = 1,
    ):
        self.transformer = transformer
        self.spec = spec
        self.cfg_batch = cfg_batch
        self.cfg_group = cfg_group
        self.sp = sp
        self.ring = ring
        self.cache: Any = None  # spindle.infer.caches.StepCache
        self.current_timestep: float | None = None  # read by timestep-gated cache hooks (PAB, FasterCache)

    def set_cache(
        self, name: str | None, threshold: float | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Replace the step cache (None: no cache)."""
        if self.cache is not None:
            self.cache.disable()
            self.cache = None
        if name is not None:
            reason = self.cache_unavailable(name)
            if reason is not None:
                raise ValueError(reason)
            if name in POLICIES and POLICIES[name].needs_spatial_output:
                options = {"tensor_format": self.spec.output_layout, **(options or {})}
            self.cache = StepCache(self.transformer, name, threshold, options, lambda: self.current_timestep)

    def cache_unavailable(self, name: str) -> str | None:
        """Why step-cache policy `name` cannot run on this stage (None: it can): `set_cache` raises it,
        `cache="auto"` skips the policy."""
        policy = POLICIES.get(name)
        if policy is None:
            return None  # "auto" / unknown names: StepCache's own checks say what is wrong
        reason = policy.cfg_unavailable(self.cfg_batch, cfg_parallel=self.cfg_group is not None)
        if reason is not None:
            return reason
        if policy.needs_spatial_output and self.spec.output_layout is None:
            return (
                f"cache {name!r} splits the model output into spatial frequencies, but {self.spec.family}'s "
                "transformer outputs packed tokens [batch, tokens, channels]; use fbc, mag or taylorseer"
            )
        return None

    def _cache_context(self, name: str, req: Req, i: int) -> contextlib.AbstractContextManager[Any]:
        ctx = getattr(self.transformer, "cache_context", None)
        if ctx is None:
            return contextlib.nullcontext()
        sigmas = getattr(req.scheduler, "sigmas", None)
        sigma = float(sigmas[i]) if sigmas is not None and i < len(sigmas) else None
        steps = len(req.timesteps) if req.timesteps is not None else None
        context: contextlib.AbstractContextManager[Any] = ctx(
            name, step_index=i, sigma=sigma, num_inference_steps=steps
        )
        return context

    def _forward(self, kwargs: dict[str, Any]) -> torch.Tensor:
        return self.spec.model_output(self.transformer(**kwargs))

    def predict(self, req: Req, latents: torch.Tensor, t: torch.Tensor, i: int) -> torch.Tensor:
        spec = self.spec
        if not req.do_cfg:
            with self._cache_context("cond", req, i):
                return self._forward(spec.denoiser_kwargs(req, latents, t, "cond"))
        if self.cfg_group is not None:
            import torch.distributed as dist

            rank = dist.get_rank(self.cfg_group)
            branch = ("cond", "uncond")[rank]
            with self._cache_context(branch, req, i):
                mine = self._forward(spec.denoiser_kwargs(req, latents, t, branch)).contiguous()
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=self.cfg_group)
            cond, uncond = both
        elif self.cfg_batch:
            branches = [spec.denoiser_kwargs(req, latents, t, b) for b in ("cond", "uncond")]
            # FasterCache approximates the second half from the first: it wants [uncond; cond]
            uncond_first = self.cache is not None and self.cache.policy.needs_cfg_batch
            first, second = branches[::-1] if uncond_first else branches
            kw = spec.batch_cfg_kwargs(first, second, batch_size=latents.shape[0])
            with self._cache_context("cfg_batch", req, i):
                cond, uncond = self._forward(kw).chunk(2, dim=0)
            if uncond_first:
                cond, uncond = uncond, cond
        else:
            with self._cache_context("cond", req, i):
                cond = self._forward(spec.denoiser_kwargs(req, latents, t, "cond"))
            with self._cache_context("uncond", req, i):
                uncond = self._forward(spec.denoiser_kwargs(req, latents, t, "uncond"))
        return spec.combine_cfg(cond, uncond, req.guidance_scale)

    def check_sequence_parallel(self, req: Req) -> None:
        if self.sp * self.ring == 1:
            return
        from spindle.distributed.context_parallel import check_sequence_parallel

        try:
            seq_len = self.spec.sequence_length(req, self.transformer)
            check_sequence_parallel(self.transformer, self.sp, seq_len=seq_len, ring=self.ring)
        except ValueError as e:
            raise RequestError(str(e), field="height") from e  # the token count follows the size (and frames)

    def forward(self, req: Req) -> Req:
        check_denoising_inputs(req, self.spec)
        latents, timesteps = req.latents, req.timesteps
        if latents is None or timesteps is None:  # checked above; narrows the types
            raise RuntimeError("DenoisingStage needs req.latents and req.timesteps")
        self.check_sequence_parallel(req)
        if self.sp * self.ring > 1:  # the sequence-parallel group is sp (Ulysses) x ring
            self.spec.prepare_sequence_parallel(req, self.sp * self.ring)
        total = len(timesteps)
        if self.cache is not None:
            self.cache.start_request(total)
        reset_cache = getattr(self.transformer, "_reset_stateful_cache", None)
        if reset_cache is not None:
            reset_cache()  # cache state never leaks across requests
        try:
            with self.cache.around_request() if self.cache is not None else contextlib.nullcontext():
                req.latents = self.loop(req, latents, timesteps)
        finally:
            from spindle.infer.speedups import clear_memos

            clear_memos(self.transformer)  # per-request prompt projections (default-on memoization)
        return req

    def loop(self, req: Req, latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        total = len(timesteps)
        for i, t in enumerate(timesteps):
            req.check_cancelled()
            self.current_timestep = float(t)
            noise_pred = self.predict(req, latents, t, i)
            if noise_pred.shape != latents.shape:
                raise _contract(
                    self.spec,
                    "denoiser_kwargs / model_output",
                    "latents",
                    f"predicted with shape {tuple(noise_pred.shape)} for latents {tuple(latents.shape)}: the "
                    "transformer's inputs do not match the latents the scheduler steps",
                )
            latents = req.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            if req.progress is not None:
                req.progress(i + 1, total)
        return latents


class DecodingStage(Stage):
    """The shared VAE decode: family post-processing, denormalize, decode, to numpy in [0, 1]."""

    name = "decoding"

    def __init__(self, vae: ModelMixin, spec: InferenceSpec):
        self.vae = vae
        self.spec = spec

    def forward(self, req: Req) -> Req:
        req.check_cancelled()
        if req.latents is None:
            raise RuntimeError("DecodingStage needs req.latents: the DenoisingStage before it sets them")
        latents = self.spec.post_denoising(req.latents, req)
        if req.raw_latent_shape is None or tuple(latents.shape) != tuple(req.raw_latent_shape):
            raise _contract(
                self.spec,
                "post_denoising",
                "latents",
                f"with shape {tuple(latents.shape)}; DecodingStage needs the VAE layout Req.raw_latent_shape="
                f"{req.raw_latent_shape}",
            )
        param = next(self.vae.parameters())
        latents = latents.to(param.device, dtype=param.dtype)
        scale, shift = self.spec.decode_scale_shift(self.vae, latents)
        latents = latents / scale + shift
        decoded = self.vae.decode(latents, return_dict=False)[0]
        req.output = self.spec.postprocess(decoded, req)
        if len(req.output) != req.params.batch_size:
            raise _contract(
                self.spec,
                "postprocess",
                "output",
                f"with {len(req.output)} items for a batch of {req.params.batch_size} (one image or video each)",
            )
        return req
