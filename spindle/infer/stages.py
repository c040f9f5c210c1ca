"""The shared stages of the inference engine: denoising and decoding (the stage contract, `Stage`,
`BeforeDenoisingStage` and `InferenceSpec`, is in `spindle.contracts.stage`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from spindle.contracts.request import Req, RequestError
from spindle.contracts.stage import InferenceSpec, Stage, check_batch_tensor, contract_error
from spindle.infer.caches import POLICIES, StepCache

if TYPE_CHECKING:
    import torch.distributed as dist
    from diffusers import ModelMixin  # Any to mypy: diffusers is not followed (pyproject [tool.mypy])


def check_denoising_inputs(req: Req, spec: InferenceSpec) -> None:
    """What DenoisingStage reads, as the family's BeforeDenoisingStage must leave it (StageContractError
    naming the family and the field otherwise): float latents of the request's batch size, a non-empty
    1-D `timesteps`, a scheduler with `step`, prompt embeddings (and negative ones under CFG) per
    sample, a numeric `cfg_scale`, `raw_latent_shape` with the same batch size."""
    where = f"{spec.before_denoising_cls.__name__}"
    batch = req.params.batch_size
    latents = req.latents
    check_batch_tensor(req, spec, "latents", latents, batch, where)
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        raise contract_error(
            spec, where, "latents", f"as {getattr(latents, 'dtype', latents)}; DenoisingStage needs floats"
        )
    steps = req.timesteps
    if not isinstance(steps, torch.Tensor) or steps.ndim != 1 or len(steps) == 0:
        raise contract_error(spec, where, "timesteps", f"as {steps!r:.80}; DenoisingStage needs a non-empty 1-D tensor")
    if not callable(getattr(req.scheduler, "step", None)):
        raise contract_error(spec, where, "scheduler", f"as {type(req.scheduler).__name__}; it needs a scheduler.step")
    check_batch_tensor(req, spec, "prompt_embeds", req.prompt_embeds, batch, where)
    if req.do_cfg:
        check_batch_tensor(req, spec, "negative_prompt_embeds", req.negative_prompt_embeds, batch, where + " (CFG on)")
    if isinstance(req.cfg_scale, bool) or not isinstance(req.cfg_scale, (int, float)):
        raise contract_error(spec, where, "cfg_scale", f"as {req.cfg_scale!r}; DenoisingStage needs a number")
    shape = req.raw_latent_shape
    if not isinstance(shape, tuple) or not shape or shape[0] != batch:
        raise contract_error(spec, where, "raw_latent_shape", f"as {shape!r}; DecodingStage needs (batch={batch}, ...)")


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
        experts: dict[str, ModelMixin] | None = None,
    ):
        self.transformer = transformer
        self.spec = spec
        # every denoising transformer by component name: the main one, plus a two-expert family's second
        self.denoisers: dict[str, Any] = {spec.transformer_component: transformer, **(experts or {})}
        self.cfg_batch = cfg_batch
        self.cfg_group = cfg_group
        self.sp = sp
        self.ring = ring
        self.caches: dict[str, Any] = {}  # spindle.infer.caches.StepCache per denoiser (each its own hooks)
        self.current_timestep: float | None = None  # read by timestep-gated cache hooks (PAB, FasterCache)

    @property
    def cache(self) -> Any:
        """The main transformer's step cache (None: no cache); `caches` holds every denoiser's."""
        return self.caches.get(self.spec.transformer_component)

    def set_cache(
        self, name: str | None, threshold: float | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Replace the step cache (None: no cache): one per denoiser, each skipping within its own steps."""
        for cache in self.caches.values():
            cache.disable()
        self.caches = {}
        if name is not None:
            reason = self.cache_unavailable(name)
            if reason is not None:
                raise ValueError(reason)
            if name in POLICIES and POLICIES[name].needs_spatial_output:
                options = {"tensor_format": self.spec.output_layout, **(options or {})}
            self.caches = {
                component: StepCache(model, name, threshold, options, lambda: self.current_timestep)
                for component, model in self.denoisers.items()
            }

    def cache_unavailable(self, name: str) -> str | None:
        """Why step-cache policy `name` cannot run on this stage (None: it can): `set_cache` raises it,
        `cache="auto"` skips the policy."""
        policy = POLICIES.get(name)
        if policy is None:
            return None  # "auto" / unknown names: StepCache's own checks say what is wrong
        own = self.spec.cache_unavailable(name)
        if own is not None:
            return own
        if not all(hasattr(model, "enable_cache") for model in self.denoisers.values()):
            # the policies are diffusers' cache hooks, applied through the transformer's CacheMixin
            return (
                f"cache {name!r} is a diffusers cache hook, but {type(self.transformer).__name__} ({self.spec.family}) "
                "does not support diffusers' caches (no CacheMixin); run without a cache"
            )
        if name == "mag" and len(self.denoisers) > 1:
            return (
                f"cache 'mag' calibrates its ratios over one model's whole schedule, but {self.spec.family} "
                "denoises with two experts, each over part of it; use fbc, taylorseer, pab or faster"
            )
        reason = policy.cfg_unavailable(self.cfg_batch, cfg_parallel=self.cfg_group is not None)
        if reason is not None:
            return reason
        if policy.needs_spatial_output and self.spec.output_layout is None:
            return (
                f"cache {name!r} splits the model output into spatial frequencies, but {self.spec.family}'s "
                "transformer outputs packed tokens [batch, tokens, channels]; use fbc, mag or taylorseer"
            )
        return None

    def _cache_context(self, model: Any, name: str, req: Req, i: int) -> contextlib.AbstractContextManager[Any]:
        ctx = getattr(model, "cache_context", None)
        if ctx is None:
            return contextlib.nullcontext()
        sigmas = getattr(req.scheduler, "sigmas", None)
        sigma = float(sigmas[i]) if sigmas is not None and i < len(sigmas) else None
        steps = len(req.timesteps) if req.timesteps is not None else None
        context: contextlib.AbstractContextManager[Any] = ctx(
            name, step_index=i, sigma=sigma, num_inference_steps=steps
        )
        return context

    def predict(self, req: Req, latents: torch.Tensor, t: torch.Tensor, i: int) -> torch.Tensor:
        spec = self.spec
        component, cfg_scale = spec.step_denoiser(req, t)
        model = self.denoisers[component]

        def forward(kwargs: dict[str, Any]) -> torch.Tensor:
            # an edit family's reference tokens are dropped from each branch, before CFG combines them
            return spec.target_prediction(spec.model_output(model(**kwargs)), latents)

        def context(branch: str) -> contextlib.AbstractContextManager[Any]:
            return self._cache_context(model, branch, req, i)

        preds = self.cfg_predictions(req, latents, t, component, forward, context)
        for branch in spec.guidance_branches(req):  # a perturbed model's predictions (one forward each)
            with context(branch):
                preds[branch] = forward(spec.denoiser_kwargs(req, latents, t, branch))
        return spec.guide(req, latents, i, preds, cfg_scale)

    def cfg_predictions(
        self, req: Req, latents: torch.Tensor, t: torch.Tensor, component: str, forward: Any, context: Any
    ) -> dict[str, torch.Tensor]:
        """{"cond": ...} and, under CFG, "uncond": one forward each, one batched forward or one per CFG rank."""
        spec = self.spec
        if not req.do_cfg:
            with context("cond"):
                return {"cond": forward(spec.denoiser_kwargs(req, latents, t, "cond"))}
        if self.cfg_group is not None:
            import torch.distributed as dist

            rank = dist.get_rank(self.cfg_group)
            branch = ("cond", "uncond")[rank]
            with context(branch):
                mine = forward(spec.denoiser_kwargs(req, latents, t, branch)).contiguous()
            both = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(both, mine, group=self.cfg_group)
            cond, uncond = both
        elif self.cfg_batch:
            branches = [spec.denoiser_kwargs(req, latents, t, b) for b in ("cond", "uncond")]
            # FasterCache approximates the second half from the first: it wants [uncond; cond]
            uncond_first = bool(self.caches) and self.caches[component].policy.needs_cfg_batch
            first, second = branches[::-1] if uncond_first else branches
            kw = spec.batch_cfg_kwargs(first, second, batch_size=latents.shape[0])
            with context("cfg_batch"):
                cond, uncond = forward(kw).chunk(2, dim=0)
            if uncond_first:
                cond, uncond = uncond, cond
        else:
            with context("cond"):
                cond = forward(spec.denoiser_kwargs(req, latents, t, "cond"))
            with context("uncond"):
                uncond = forward(spec.denoiser_kwargs(req, latents, t, "uncond"))
        return {"cond": cond, "uncond": uncond}

    def check_sequence_parallel(self, req: Req) -> None:
        if self.sp * self.ring == 1:
            return
        from spindle.distributed.context_parallel import check_sequence_parallel

        try:
            seq_len = self.spec.sequence_length(req, self.transformer)
            check_sequence_parallel(self.transformer, self.sp, seq_len=seq_len, ring=self.ring)
        except ValueError as e:
            raise RequestError(str(e), field="height") from e  # the token count follows the size (and frames)
        self.spec.check_sequence_parallel(req, self.transformer, self.sp * self.ring)

    def check_inputs(self, req: Req) -> None:
        check_denoising_inputs(req, self.spec)

    def forward(self, req: Req) -> Req:
        latents, timesteps = req.latents, req.timesteps
        if latents is None or timesteps is None:  # checked above; narrows the types
            raise RuntimeError("DenoisingStage needs req.latents and req.timesteps")
        self.check_sequence_parallel(req)
        if self.sp * self.ring > 1:  # the sequence-parallel group is sp (Ulysses) x ring
            self.spec.prepare_sequence_parallel(req, self.sp * self.ring)
        total = len(timesteps)
        for cache in self.caches.values():
            cache.start_request(total)
        for model in self.denoisers.values():
            reset_cache = getattr(model, "_reset_stateful_cache", None)
            if reset_cache is not None:
                reset_cache()  # cache state never leaks across requests
        try:
            with contextlib.ExitStack() as stack:
                for cache in self.caches.values():
                    stack.enter_context(cache.around_request())
                stack.enter_context(self.cancellable_blocks(req))
                req.latents = self.loop(req, latents, timesteps)
        finally:
            from spindle.infer.speedups import clear_memos

            for model in self.denoisers.values():
                clear_memos(model)  # per-request prompt projections (default-on memoization)
        return req

    @contextlib.contextmanager
    def cancellable_blocks(self, req: Req) -> Any:
        """One process: a cancelled request (a client that hung up, a shutdown) also stops between the denoisers'
        blocks, not only between steps (a step of a large model takes seconds to minutes). Each block of a
        transformer's block lists checks first, before any other hook of it (an offload's weight move). Not on
        several ranks: a rank leaving mid-forward would strand its peers in a collective; they stop between steps,
        together."""
        import torch.distributed as dist

        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if req.should_stop is None or several:
            yield
            return

        def check(module: torch.nn.Module, args: Any) -> None:
            req.check_cancelled()

        handles = [
            block.register_forward_pre_hook(check, prepend=True)
            for model in self.denoisers.values()
            for blocks in model.children()
            if isinstance(blocks, torch.nn.ModuleList)
            for block in blocks
            # a compiled block would trace the hook (a graph break, or an error under fullgraph): steps only
            if getattr(block, "_compiled_call_impl", None) is None
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def loop(self, req: Req, latents: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        total = len(timesteps)
        for i, t in enumerate(timesteps):
            req.check_cancelled()
            self.current_timestep = float(t)
            noise_pred = self.predict(req, latents, t, i)
            if noise_pred.shape != latents.shape:
                raise contract_error(
                    self.spec,
                    "denoiser_kwargs / model_output",
                    "latents",
                    f"predicted with shape {tuple(noise_pred.shape)} for latents {tuple(latents.shape)}: the "
                    "transformer's inputs do not match the latents the scheduler steps",
                )
            if req.step is not None:
                latents = req.step(req.scheduler, noise_pred, t, i, latents)
            else:
                latents = req.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
            if req.progress is not None:
                req.progress(i + 1, total)
        return latents


class DecodingStage(Stage):
    """The shared VAE decode: family post-processing, denormalize, decode, to numpy in [0, 1]."""

    name = "decoding"

    def __init__(self, vae: ModelMixin, spec: InferenceSpec, components: dict[str, Any] | None = None):
        self.vae = vae
        self.spec = spec
        self.components = components or {}  # what the family's `decode_audio` reads (an audio VAE, a vocoder)

    def check_inputs(self, req: Req) -> None:
        if req.latents is None:
            raise RuntimeError("DecodingStage needs req.latents: the DenoisingStage before it sets them")

    def forward(self, req: Req) -> Req:
        req.check_cancelled()
        if req.latents is None:  # checked by check_inputs; narrows the type
            raise RuntimeError("DecodingStage needs req.latents")
        latents = self.spec.post_denoising(req.latents, req)
        if req.raw_latent_shape is None or tuple(latents.shape) != tuple(req.raw_latent_shape):
            raise contract_error(
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
        chunks = latents.split(self.spec.videos_per_decode or latents.shape[0])
        decoded = torch.cat([self.vae.decode(chunk, return_dict=False)[0] for chunk in chunks])
        req.output = self.spec.postprocess(decoded, req)
        audio = self.spec.decode_audio(req, self.components)
        if audio is not None:
            req.audio, req.audio_sample_rate = audio
        return req

    def check_outputs(self, req: Req) -> None:
        if req.output is None or len(req.output) != req.params.batch_size:
            count = "no" if req.output is None else len(req.output)
            raise contract_error(
                self.spec,
                "postprocess",
                "output",
                f"with {count} items for a batch of {req.params.batch_size} (one image or video each)",
            )
