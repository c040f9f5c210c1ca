"""The stage contract of the inference engine and what a family plugs into it.

Request flow (SGLang-diffusion's hybrid style):

    family BeforeDenoisingStage  ->  DenoisingStage (shared)  ->  DecodingStage (shared)

The shared stages (`spindle.infer.stages`) never branch on the family. Whatever differs between
families goes through an `InferenceSpec` (one per family, in `spindle/models/<family>/inference.py`):

- `denoiser_kwargs(req, latents, t, branch)`: the transformer's forward kwargs for one step and one
  CFG branch ("cond" / "uncond"); the embedded guidance of a guidance-distilled transformer is
  `req.embedded_guidance`, other conditioning (pooled embeddings, image ids) comes from `req.extra`.
- `batch_cfg_kwargs(cond, uncond)`: how the two branches become one forward (default: concatenate
  every per-sample tensor along the batch, keep shared tensors such as position ids once).
- `post_denoising(latents, req)`: e.g. unpack packed latents back to the VAE layout.
- `decode_scale_shift(vae, latents)`: `(scale, shift)` with `vae_input = latents / scale + shift`.
- `postprocess(decoded, req)`: VAE output -> float32 numpy in [0, 1] (diffusers' `output_type="np"`).

Every `Stage` checks its inputs and outputs (`check_inputs` / `check_outputs`) around `forward`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from spindle.contracts.options import FamilyOptions
from spindle.contracts.request import Req, SamplingParams


class Stage:
    """One step of the pipeline: `forward(req) -> req`. `name` keys the per-stage timing.

    The contract (SGLang-diffusion's per-stage checks): `check_inputs(req)` names the `Req` fields the
    stage reads that a stage before it left wrong, `check_outputs(req)` what this stage must leave for
    the next; both raise `StageContractError` (or `RequestError` for a request the model cannot serve).
    Calling a stage runs the three in order, so every pipeline checks every stage."""

    name: ClassVar[str] = "stage"

    def check_inputs(self, req: Req) -> None:
        """Raise when `req` lacks what `forward` reads. Default: nothing to check."""

    def forward(self, req: Req) -> Req:
        raise NotImplementedError

    def check_outputs(self, req: Req) -> None:
        """Raise when `forward` left `req` without what the next stage reads. Default: nothing."""

    def __call__(self, req: Req) -> Req:
        self.check_inputs(req)
        with torch.no_grad():
            req = self.forward(req)
        self.check_outputs(req)
        return req


class BeforeDenoisingStage(Stage):
    """Model-specific pre-processing: validate, encode prompt(s), prepare latents and timesteps.

    A subclass is built with the loaded components (`components[name]` as named in model_index.json)
    and must leave on the Req every field DenoisingStage reads: `latents`, `timesteps`, `scheduler`,
    `prompt_embeds` (+ `negative_prompt_embeds` when `do_cfg`), `cfg_scale`, `model_dtype`,
    `raw_latent_shape`, plus whatever its spec's `denoiser_kwargs` needs in `req.extra`.
    """

    name = "before_denoising"

    def __init__(self, components: dict[str, Any], spec: InferenceSpec):
        self.components = components
        self.spec = spec

    def validate(self, params: SamplingParams) -> None:
        """Raise `RequestError` for requests this model cannot serve (no silent rounding): the checks that need
        the loaded model (sizes, frame counts, text length), on params the family's schema has validated and
        the defaults filled (`DiffusionGenerator.validate`). Nothing here: a family adds its own."""

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
    # component -> "module:function(folder) -> the loaded component", for one the class model_index.json names
    # cannot load here (Qwen-Image-Edit's Qwen2VLProcessor needs torchvision: its processor is assembled)
    component_loaders: dict[str, str] = {}
    transformer_component: str = "transformer"
    # further transformers that denoise some of the steps (Wan2.2 A14B's low-noise expert "transformer_2"):
    # loaded, sped up, offloaded and sequence-parallelized as the main one; `step_denoiser` picks per step
    expert_components: tuple[str, ...] = ()
    # model_index.json config values the family's stages read (e.g. "boundary_ratio"), handed to them in
    # `components` under the same name (None when the folder does not set it)
    pipeline_config: tuple[str, ...] = ()
    vae_component: str = "vae"
    # an export's default max_sequence_length is the text length it was trained with; False where the stock
    # pipeline fixes its text length (HunyuanVideo-1.5 pads to 1000 tokens), which the engine then keeps
    follows_trained_text_length: bool = True
    # videos the VAE decodes at once (None: the whole batch); 1 where the VAE takes one at a time (diffusers'
    # AutoencoderKLHunyuanVideo15 builds its mid-block attention mask for one video)
    videos_per_decode: int | None = None
    before_denoising_cls: type[BeforeDenoisingStage] = BeforeDenoisingStage
    # the family's declared sampling options (the same object as its family record's `options`)
    options: FamilyOptions = FamilyOptions()

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

    @property
    def denoiser_components(self) -> tuple[str, ...]:
        """Every transformer that denoises: the main one first, then the experts."""
        return (self.transformer_component, *self.expert_components)

    def step_denoiser(self, req: Req, t: torch.Tensor) -> tuple[str, float]:
        """(the component that denoises the step at timestep `t`, its CFG scale). Default: the one
        transformer at the request's scale; a two-expert family switches at its boundary."""
        return self.transformer_component, req.cfg_scale

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

    def cache_unavailable(self, name: str) -> str | None:
        """Why step-cache policy `name` (spindle.infer.caches) cannot run on this family's transformer (None: it
        can), e.g. a hook that cannot read its blocks' outputs. Default: every policy can."""
        return None

    def sequence_parallel_plan(self, transformer_config: Mapping[str, Any]) -> dict[str, Any] | None:
        """The diffusers context-parallel plan SP applies to the transformer with `transformer_config` (training
        and inference alike); None: the model class' own `_cp_plan` (LTX-2 splits its audio stream too)."""
        return None

    def check_sequence_parallel(self, req: Req, transformer: torch.nn.Module, degree: int) -> None:
        """Before a `degree`-way SP request does any work: raise RequestError for sequences other than the one
        `sequence_length` counts that the plan splits and that do not divide `degree` (LTX-2's audio tokens).
        Default: nothing."""

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

    def target_prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The part of one forward's output (`model_output`) that the scheduler steps with `latents`. Edit
        families append their reference images' tokens to the latents' on the sequence axis and keep the
        prediction of the first `latents.shape[1]` (FluxKontextPipeline's `noise_pred[:, : latents.size(1)]`),
        before CFG combines the branches. Default: all of it."""
        return pred

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        return uncond + cfg_scale * (cond - uncond)

    def guidance_branches(self, req: Req) -> tuple[str, ...]:
        """Forwards the step runs besides "cond" (and "uncond" under CFG), each with `denoiser_kwargs(..., branch)`
        and handed to `guide` by name: a perturbed model's prediction (LTX-2's spatio-temporal and
        modality-isolation guidance). Default: none."""
        return ()

    def guide(
        self, req: Req, latents: torch.Tensor, i: int, preds: dict[str, torch.Tensor], cfg_scale: float
    ) -> torch.Tensor:
        """The step's prediction (what the scheduler steps `latents` with at step `i`) from the branches' predictions
        by name ("cond", "uncond" under CFG, then `guidance_branches`). Default: `combine_cfg`, or "cond" alone."""
        if "uncond" not in preds:
            return preds["cond"]
        return self.combine_cfg(preds["cond"], preds["uncond"], cfg_scale)

    # --- DecodingStage callbacks
    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        return latents

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[float | torch.Tensor, float | torch.Tensor]:
        """(scale, shift) of `vae_input = latents / scale + shift`: floats from the VAE's config, or tensors
        broadcastable to the latents (a VAE with per-channel mean / std)."""
        cfg = vae.config
        return getattr(cfg, "scaling_factor", 1.0), getattr(cfg, "shift_factor", None) or 0.0

    def decode_audio(self, req: Req, components: dict[str, Any]) -> tuple[np.ndarray, int] | None:
        """The request's soundtrack, after the video is decoded: (float32 [B, channels, samples] in [-1, 1], its
        sample rate), which the engine returns and writes into the mp4. Default: None (silent media)."""
        return None

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


def contract_error(spec: InferenceSpec, where: str, field: str, problem: str) -> StageContractError:
    family = spec.family or type(spec).__name__
    return StageContractError(f"family {family!r}: {where} left Req.{field} {problem}")


def check_batch_tensor(req: Req, spec: InferenceSpec, field: str, value: Any, batch: int, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise contract_error(spec, where, field, f"as {type(value).__name__}; DenoisingStage needs a tensor")
    if value.ndim < 2 or value.shape[0] != batch:
        raise contract_error(
            spec, where, field, f"with shape {tuple(value.shape)}; DenoisingStage needs [batch={batch}, ...]"
        )
