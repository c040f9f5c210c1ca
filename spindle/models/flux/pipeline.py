"""FLUX.1 text-to-image inference: its BeforeDenoisingStage, the shared stages' callbacks, defaults.

Mirrors diffusers' `FluxPipeline.__call__` up to the denoising loop: prompt encoding (pooled CLIP +
T5) is the pipeline's own `encode_prompt`, latents and image ids its `prepare_latents` (random
latents in the VAE layout, 2x2-packed), timesteps its sigmas with the resolution-dependent shift
`mu`. `guidance_scale` is what it is in FluxPipeline: the *embedded* guidance of guidance-distilled
checkpoints (FLUX.1-dev), ignored by the others. True classifier-free guidance is
`extra["true_cfg_scale"] > 1` with a `negative_prompt`, run by the shared DenoisingStage (batched,
two forwards, or CFG-parallel), exactly FluxPipeline's `true_cfg_scale`.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from spindle.infer.request import Req, RequestError, SamplingParams, check_int_range, check_size, resolved
from spindle.infer.stages import BeforeDenoisingStage, InferenceSpec
from spindle.models.base import resolution_shift

EXTRA_KEYS = ("true_cfg_scale",)  # the family-specific request knobs (SamplingParams.extra)
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's limit for the T5 prompt


def _text_pipeline(components: dict[str, Any]) -> Any:
    """A FluxPipeline without transformer: its prompt encoding and latent helpers are the reference."""
    from diffusers import FluxPipeline

    return FluxPipeline(
        scheduler=components["scheduler"],
        vae=components["vae"],
        text_encoder=components["text_encoder"],
        tokenizer=components["tokenizer"],
        text_encoder_2=components["text_encoder_2"],
        tokenizer_2=components["tokenizer_2"],
        transformer=None,
    )


class FluxBeforeDenoisingStage(BeforeDenoisingStage):
    def __init__(self, components: dict[str, Any], spec: InferenceSpec):
        super().__init__(components, spec)
        self.text_pipe = _text_pipeline(components)
        self.transformer = components["transformer"]
        self.scheduler = components["scheduler"]
        self.vae_scale_factor = self.text_pipe.vae_scale_factor
        self.multiple = 2 * self.vae_scale_factor  # VAE downsampling x 2x2 packing

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_size(params, self.multiple, self.multiple, f"VAE x{self.vae_scale_factor} x 2x2 packing")
        if params.num_frames not in (None, 1):
            raise RequestError(
                f"num_frames must be left unset (or 1): Flux generates images; got {params.num_frames!r}"
            )
        check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=MAX_SEQUENCE_LENGTH)
        unknown = sorted(set(params.extra) - set(EXTRA_KEYS))
        if unknown:
            raise RequestError(f"unknown Flux option(s) {unknown}; known: {list(EXTRA_KEYS)}")
        scale = params.extra.get("true_cfg_scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
            raise RequestError(
                f"true_cfg_scale must be a number >= 0 (> 1 with a negative_prompt enables CFG); got {scale!r}"
            )
        if scale > 1 and params.negative_prompt is None:
            raise RequestError(
                f"true_cfg_scale={scale} needs a negative_prompt (FluxPipeline would silently skip CFG); pass "
                'negative_prompt ("" for an empty one) or set true_cfg_scale to 1'
            )

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, ...]:
        return self.text_pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=p.num_outputs_per_prompt,
            max_sequence_length=p.max_sequence_length,
        )

    def forward(self, req: Req) -> Req:
        p = req.params
        self.validate(p)
        device = req.device
        true_cfg = float(p.extra.get("true_cfg_scale", 1.0))
        req.do_cfg = true_cfg > 1 and p.negative_prompt is not None
        req.guidance_scale = true_cfg  # the CFG scale the shared DenoisingStage combines with
        dtype = self.transformer.dtype
        req.model_dtype = dtype

        embeds, pooled, txt_ids = self.encode(p.prompts, p, device)
        req.prompt_embeds = embeds.to(dtype)
        req.extra.update(pooled=pooled.to(dtype), txt_ids=txt_ids.to(dtype))
        if req.do_cfg:
            negative = p.negative_prompt
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            neg_embeds, neg_pooled, neg_txt_ids = self.encode(resolved(negative, "negative_prompt"), p, device)
            req.negative_prompt_embeds = neg_embeds.to(dtype)
            req.extra.update(negative_pooled=neg_pooled.to(dtype), negative_txt_ids=neg_txt_ids.to(dtype))

        num_channels = self.transformer.config.in_channels // 4
        latents, img_ids = self.text_pipe.prepare_latents(
            p.batch_size,
            num_channels,
            height := resolved(p.height, "height"),
            width := resolved(p.width, "width"),
            torch.float32,
            device,
            req.generator,
        )
        req.latents = latents
        req.extra["img_ids"] = img_ids.to(dtype)
        req.raw_latent_shape = (
            p.batch_size,
            num_channels,
            height // self.vae_scale_factor,
            width // self.vae_scale_factor,
        )

        if self.transformer.config.guidance_embeds:
            guidance = torch.full(
                [1], float(resolved(p.guidance_scale, "guidance_scale")), device=device, dtype=torch.float32
            )
            req.extra["guidance"] = guidance.expand(latents.shape[0])
        else:
            req.extra["guidance"] = None

        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        steps = resolved(p.num_inference_steps, "num_inference_steps")
        sigmas: np.ndarray | None = np.linspace(1.0, 1 / steps, steps)
        if getattr(self.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu, _ = resolution_shift(self.scheduler, latents.shape[1])
        scheduler = copy.deepcopy(self.scheduler)  # schedulers are stateful: one copy per request
        req.timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        req.scheduler = scheduler
        return req


class FluxInference(InferenceSpec):
    family = "flux"
    media = "image"
    components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae", "scheduler", "transformer")
    before_denoising_cls = FluxBeforeDenoisingStage

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # diffusers FluxPipeline.__call__ defaults: 128 latent pixels x VAE factor, 28 steps, guidance 3.5.
        size = 128 * 2 ** (len(components["vae"].config.block_out_channels) - 1)
        return SamplingParams(
            negative_prompt=None,
            height=size,
            width=size,
            num_inference_steps=28,
            guidance_scale=3.5,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            extra={"true_cfg_scale": 1.0},
        )

    def check_checkpoint(self, model_index: dict) -> None:
        if (model_index.get("image_encoder") or [None])[0]:
            raise NotImplementedError("Flux checkpoints with an IP-Adapter image encoder are not supported yet")

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        cond = branch == "cond"
        x = req.extra
        return {
            "hidden_states": latents.to(req.model_dtype),
            "timestep": t.expand(latents.shape[0]).to(latents.dtype) / 1000,
            "guidance": x["guidance"],
            "pooled_projections": x["pooled"] if cond else x["negative_pooled"],
            "encoder_hidden_states": req.prompt_embeds if cond else req.negative_prompt_embeds,
            "txt_ids": x["txt_ids"] if cond else x["negative_txt_ids"],
            "img_ids": x["img_ids"],
            "joint_attention_kwargs": None,
            "return_dict": False,
        }

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        _, _, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        return (h // 2) * (w // 2)

    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        from diffusers import FluxPipeline

        height, width = resolved(req.params.height, "height"), resolved(req.params.width, "width")
        vae_scale = height // resolved(req.raw_latent_shape, "raw_latent_shape")[2]
        return FluxPipeline._unpack_latents(latents, height, width, vae_scale)


FLUX_INFERENCE = FluxInference()
