"""Wan2.1 image-to-video inference: Wan's BeforeDenoisingStage plus the conditioning image.

Mirrors diffusers' `WanImageToVideoPipeline.__call__` up to the denoising loop: the prompt through its
`encode_prompt`, the image through its `encode_image` (CLIP penultimate hidden states) and its
`video_processor.preprocess` (resized to the request's height x width, as the pipeline does), then its
own `prepare_latents` (noise from the request's generator, the VAE-encoded conditioning video and the
frame mask). Each step the transformer sees [latents, mask, conditioning latents] on the channel axis.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.wan.inference import WanBeforeDenoisingStage, WanInference
from spindle.models.wan_i2v import OPTIONS, TEXT_LENGTH


class WanI2VBeforeDenoisingStage(WanBeforeDenoisingStage):
    def make_reference_pipe(self, components: dict[str, Any]) -> Any:
        from diffusers import WanImageToVideoPipeline

        return self.reference_pipe(
            WanImageToVideoPipeline,
            components,
            image_processor=components.get("image_processor"),
            image_encoder=components.get("image_encoder"),
        )

    @property
    def latent_channels(self) -> int:
        return int(self.components["vae"].config.z_dim)

    @property
    def takes_image_embeds(self) -> bool:
        """Wan2.1 I2V transformers project CLIP image embeddings (`image_dim`); Wan2.2 ones take none."""
        return self.transformer.config.image_dim is not None

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        if self.takes_image_embeds and params.max_sequence_length != TEXT_LENGTH:
            raise RequestError(
                f"max_sequence_length must be {TEXT_LENGTH} for this model: its transformer reads the last "
                f"{TEXT_LENGTH} context tokens as text and the rest as image (got {params.max_sequence_length!r})",
                field="max_sequence_length",
            )
        if not params.image:
            raise RequestError(
                "image is required: this is an image-to-video model; give the first frame", field="image"
            )
        folds_two = self.transformer.config.pos_embed_seq_len is not None  # an FLF2V image embedder
        if len(params.image) == 1 and self.takes_image_embeds and folds_two:
            raise RequestError(
                "last_image is required for this first-last-frame (FLF2V) checkpoint: its transformer embeds the "
                "first and the last frame of every video (pos_embed_seq_len in its config); give last_image",
                field="last_image",
            )
        if len(params.image) == 2 and self.takes_image_embeds and not folds_two:
            # the stock pipeline would hand this transformer two images' embeddings per sample and fail mid-run
            raise RequestError(
                "last_image needs a first-last-frame (FLF2V) checkpoint: this transformer embeds one image per "
                "video (its config has no pos_embed_seq_len); drop last_image",
                field="last_image",
            )

    def forward(self, req: Req) -> Req:
        req = super().forward(req)  # prompts, scheduler, timesteps, and the noise (req.latents)
        image, *last = resolved(req.params.image, "image")  # the first frame (and the last one: FLF2V)
        if self.takes_image_embeds:
            embeds = self.text_pipe.encode_image(image if not last else [image, *last], req.device)
            # the pipeline repeats by the prompt count; per output keeps num_outputs_per_prompt > 1 valid
            # (FLF2V: two rows per sample, which the transformer's image embedder folds into one)
            req.extra["image_embeds"] = embeds.repeat(req.params.batch_size, 1, 1).to(req.model_dtype)
        latents, condition = self.image_latents(req, image, *last)
        req.latents = latents
        req.extra["condition"] = condition
        return req


class WanI2VInference(WanInference):
    options = OPTIONS
    family = "wan_i2v"
    two_expert_family = "wan22_i2v"
    components: tuple[str, ...] = (
        "tokenizer",
        "text_encoder",
        "image_processor",
        "image_encoder",
        "vae",
        "scheduler",
        "transformer",
    )
    before_denoising_cls = WanI2VBeforeDenoisingStage

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        return super().default_params(components)  # WanImageToVideoPipeline.__call__ has WanPipeline's defaults

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        kwargs = super().denoiser_kwargs(req, latents, t, branch)
        kwargs["hidden_states"] = torch.cat([latents, req.extra["condition"]], dim=1).to(req.model_dtype)
        kwargs["encoder_hidden_states_image"] = req.extra.get("image_embeds")
        return kwargs

    def batch_cfg_kwargs(self, cond: dict[str, Any], uncond: dict[str, Any], batch_size: int) -> dict[str, Any]:
        # The image embeddings are per sample even where they are identical in both branches, and an FLF2V
        # request has two rows per sample (2B, not B): concatenate them as the latents are.
        images = [kw.pop("encoder_hidden_states_image", None) for kw in (cond, uncond)]
        merged = super().batch_cfg_kwargs(cond, uncond, batch_size)
        merged["encoder_hidden_states_image"] = None if images[0] is None else torch.cat(images)
        return merged

    def request_constant_modules(self, transformer: torch.nn.Module, compiled: bool) -> list[torch.nn.Module]:
        # The image embeddings enter like the prompt's: their projection and each cross-attention's image
        # key/value (+ its RMSNorm) are the same every step.
        modules = super().request_constant_modules(transformer, compiled)
        wan: Any = transformer  # diffusers WanTransformer3DModel
        if wan.condition_embedder.image_embedder is not None:
            modules.append(wan.condition_embedder.image_embedder)
            if not compiled:
                for block in wan.blocks:
                    attn = block.attn2
                    if not attn.fused_projections and attn.add_k_proj is not None:
                        modules += [attn.add_k_proj, attn.add_v_proj, attn.norm_added_k]
        return modules


INFERENCE = WanI2VInference()
