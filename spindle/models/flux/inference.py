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

from typing import Any

import torch

from spindle.contracts.request import Req, SamplingParams, resolved
from spindle.model_index import component_class
from spindle.models.flux import OPTIONS
from spindle.models.shared.inference import (
    PackedImageInference,
    PipelineBeforeDenoisingStage,
    check_packed_image_request,
)

MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's limit for the T5 prompt


class FluxBeforeDenoisingStage(PipelineBeforeDenoisingStage):
    pipeline_class = "diffusers:FluxPipeline"
    scheduler_may_own_sigmas = True  # FluxPipeline: a scheduler with use_flow_sigmas picks its own

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_packed_image_request(params, self.vae_scale_factor, MAX_SEQUENCE_LENGTH, "Flux")
        # No positional-range check (unlike Wan and Qwen-Image): FluxPosEmbed computes each rotary
        # angle from the position id, with no table to overrun. Prompts past max_sequence_length T5
        # tokens (or CLIP's 77) are truncated as in FluxPipeline, which logs it.
        # true_cfg_scale (type, bounds, needs a negative prompt) is checked by its declaration in FAMILY.options

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        return (
            p.batch_size,
            self.transformer.config.in_channels // 4,  # packed 2x2 in the transformer's input
            resolved(p.height, "height") // self.vae_scale_factor,
            resolved(p.width, "width") // self.vae_scale_factor,
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
        self.set_prompts(req)
        self.set_latents(req)
        self.set_embedded_guidance(req, req.device)
        self.set_timesteps(req, req.device)
        return req

    def set_prompts(self, req: Req) -> None:
        """CFG settings and the prompt embeddings (pooled and per token, with their text ids), as
        FluxPipeline encodes them: `true_cfg_scale > 1` with a negative prompt enables true CFG."""
        p = req.params
        device = req.device
        true_cfg = float(p.extra["true_cfg_scale"])
        req.do_cfg = true_cfg > 1 and p.negative_prompt is not None
        req.cfg_scale = true_cfg  # the CFG scale the shared DenoisingStage combines with
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

    def set_latents(self, req: Req) -> None:
        """The noise (packed, drawn in the VAE layout from the request's generator) and the image ids,
        by FluxPipeline's own `prepare_latents`."""
        p = req.params
        latents, img_ids = self.text_pipe.prepare_latents(*self.latent_args(req))
        req.latents = latents
        req.extra["img_ids"] = img_ids.to(req.model_dtype)
        req.raw_latent_shape = self.latent_shape(p)


class FluxInference(PackedImageInference):
    options = OPTIONS
    family = "flux"
    pipeline_class = FluxBeforeDenoisingStage.pipeline_class
    components = ("tokenizer", "tokenizer_2", "text_encoder", "text_encoder_2", "vae", "scheduler", "transformer")
    before_denoising_cls = FluxBeforeDenoisingStage

    def pipeline_defaults(self, components: dict[str, Any]) -> SamplingParams:
        # diffusers FluxPipeline.__call__ defaults: 128 latent pixels x VAE factor, 28 steps, guidance 3.5.
        size = 128 * 2 ** (len(components["vae"].config.block_out_channels) - 1)
        return SamplingParams(
            negative_prompt=None,
            height=size,
            width=size,
            num_inference_steps=28,
            guidance_scale=3.5,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )

    def check_checkpoint(self, model_index: dict) -> None:
        if component_class(model_index, "image_encoder"):
            raise NotImplementedError("Flux checkpoints with an IP-Adapter image encoder are not supported yet")

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        cond = branch == "cond"
        x = req.extra
        return {
            **self.packed_kwargs(req, latents, t, branch),
            "pooled_projections": x["pooled"] if cond else x["negative_pooled"],
            "txt_ids": x["txt_ids"] if cond else x["negative_txt_ids"],
            "img_ids": x["img_ids"],
            "joint_attention_kwargs": None,
        }

    def linear_gelu_pairs(self, transformer: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str]]:
        # single-stream blocks: act_mlp(proj_mlp(x)), two modules (the double-stream ones use diffusers' GELU)
        flux: Any = transformer  # diffusers FluxTransformer2DModel
        return [(block, "proj_mlp", "act_mlp") for block in flux.single_transformer_blocks]


INFERENCE = FluxInference()
