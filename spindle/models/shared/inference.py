"""Inference pieces shared by pipeline-backed families: a BeforeDenoisingStage around the family's own
diffusers pipeline, and the spec and request checks of 2x2-packed image families."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import numpy as np
import torch

from spindle.contracts.family import import_object
from spindle.contracts.request import Req, RequestError, SamplingParams, check_int_range, check_size, resolved
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec
from spindle.models.shared.latents import resolution_shift
from spindle.models.shared.reference_tokens import ReferenceTokens


class PipelineBeforeDenoisingStage(BeforeDenoisingStage):
    """A BeforeDenoisingStage around the family's diffusers pipeline, built from the loaded components
    without its transformer (`pipeline_class = "diffusers:FluxPipeline"`): its prompt encoding and
    latent helpers are the reference code (`self.text_pipe`)."""

    pipeline_class: str = ""
    # FluxPipeline lets a scheduler configured with `use_flow_sigmas` choose its own sigmas; others pass theirs
    scheduler_may_own_sigmas: bool = False

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        parts = {k: v for k, v in components.items() if k != spec.transformer_component}
        self.text_pipe = import_object(self.pipeline_class)(**parts, transformer=None)
        self.transformer = components[spec.transformer_component]
        self.scheduler = components["scheduler"]
        self.vae_scale_factor = self.text_pipe.vae_scale_factor

    def latent_args(self, req: Req) -> tuple[Any, ...]:
        """What the packed pipelines' `prepare_latents` take after any image latents: the batch, the latent
        channels (the transformer's input over the 2x2 packing), the size, float32 (the noise's dtype), the
        device and the request's generator."""
        p = req.params
        channels = self.transformer.config.in_channels // 4
        size = resolved(p.height, "height"), resolved(p.width, "width")
        return (p.batch_size, channels, *size, torch.float32, req.device, req.generator)

    def set_embedded_guidance(self, req: Req, device: Any) -> None:
        """`req.embedded_guidance`: the guidance scale per sample for a guidance-distilled transformer
        (`guidance_embeds`), else None (as the reference pipelines)."""
        assert req.latents is not None, "set req.latents before the guidance (one value per sample)"
        if self.transformer.config.guidance_embeds:
            scale = float(resolved(req.params.guidance_scale, "guidance_scale"))
            guidance = torch.full([1], scale, device=device, dtype=torch.float32)
            req.embedded_guidance = guidance.expand(req.latents.shape[0])
        else:
            req.embedded_guidance = None

    def schedule_mu(self, image_seq_len: int, steps: int) -> float:
        """The `mu` the reference pipeline passes `set_timesteps` (its dynamic shift): FluxPipeline's
        `calculate_shift` of the image token count between the scheduler config's bounds. A pipeline computing
        it otherwise (FLUX.2's empirical mu, which also reads the step count) overrides this."""
        mu, _ = resolution_shift(self.scheduler, image_seq_len)
        return mu

    def default_sigmas(self, steps: int) -> Any:
        """The sigmas the reference pipeline passes for `steps` steps: linear 1 -> 1/steps."""
        return np.linspace(1.0, 1 / steps, steps)

    def image_seq_len(self, latents: torch.Tensor) -> int:
        """The image token count the resolution shift reads: packed latents [B, S, C] have S."""
        return int(latents.shape[1])

    def set_timesteps(self, req: Req, device: Any) -> None:
        """`req.timesteps` and `req.scheduler` (a per-request copy: schedulers are stateful) as the
        reference pipeline computes them: its sigmas (`default_sigmas`), shifted for the request's image
        token count (`image_seq_len`), through the pipeline module's `retrieve_timesteps`."""
        module = importlib.import_module(type(self.text_pipe).__module__)
        retrieve_timesteps = module.retrieve_timesteps
        assert req.latents is not None, "set req.latents before the timesteps (the shift reads its token count)"
        steps = resolved(req.params.num_inference_steps, "num_inference_steps")
        sigmas: Any = self.default_sigmas(steps)
        if self.scheduler_may_own_sigmas and getattr(self.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = self.schedule_mu(self.image_seq_len(req.latents), steps)
        scheduler = copy.deepcopy(self.scheduler)
        req.timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        req.scheduler = scheduler


class PackedImageInference(InferenceSpec):
    """The inference spec of an image family whose transformer takes 2x2-packed latent tokens (Flux,
    Qwen-Image): its token count and the unpacking back to the VAE layout, by the pipeline's own
    `_unpack_latents` (`pipeline_class`, as the before-denoising stage names it). An image-editing variant
    (FLUX.1 Kontext, Qwen-Image-Edit) adds its `reference_tokens` part, which this spec calls."""

    media = "image"
    output_layout = None  # packed latent tokens [B, S, C]
    pipeline_class: str = ""
    # an editing variant's source-image tokens (`shared.reference_tokens`); None: text-to-image only
    reference_tokens: ReferenceTokens | None = None

    def pipeline_defaults(self, components: dict[str, Any]) -> SamplingParams:
        """The reference pipeline's `__call__` defaults."""
        return SamplingParams()

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        params = self.pipeline_defaults(components)
        return params if self.reference_tokens is None else self.reference_tokens.default_params(params)

    def packed_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        """The denoiser arguments of every packed image transformer: the latents (with an edit's reference tokens
        after them, `req.extra["image_latents"]`) in the model's dtype, the timestep per sample on the
        pipelines' 0-1 scale, the embedded guidance (None: not distilled), the branch's prompt embeddings."""
        hidden = latents
        reference = req.extra.get("image_latents")
        if self.reference_tokens is not None and reference is not None:
            hidden = self.reference_tokens.append(latents, [reference])
        return {
            "hidden_states": hidden.to(req.model_dtype),
            "encoder_hidden_states": req.prompt_embeds if branch == "cond" else req.negative_prompt_embeds,
            "timestep": t.expand(latents.shape[0]).to(latents.dtype) / 1000,
            "guidance": req.embedded_guidance,
            "return_dict": False,
        }

    def target_prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return pred if self.reference_tokens is None else self.reference_tokens.prediction(pred, latents)

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        h, w = resolved(req.raw_latent_shape, "raw_latent_shape")[-2:]  # [B, C, (F,) h, w]
        return (h // 2) * (w // 2)

    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        height, width = resolved(req.params.height, "height"), resolved(req.params.width, "width")
        vae_scale = height // resolved(req.raw_latent_shape, "raw_latent_shape")[-2]
        unpacked: torch.Tensor = import_object(self.pipeline_class)._unpack_latents(latents, height, width, vae_scale)
        return unpacked


def check_packed_image_request(params: Any, vae_scale_factor: int, max_sequence_length: int, label: str) -> None:
    """The request checks of a 2x2-packed image family (after the common ones): sizes a multiple of
    VAE factor x 2, no frames, the text length its encoder takes. `RequestError` naming the field."""
    multiple = 2 * vae_scale_factor
    check_size(params, multiple, multiple, f"VAE x{vae_scale_factor} x 2x2 packing")
    if params.num_frames not in (None, 1):
        raise RequestError(
            f"num_frames must be left unset (or 1): {label} generates images; got {params.num_frames!r}",
            field="num_frames",
        )
    check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=max_sequence_length)
