"""FLUX.2 inference (text-to-image and multi-reference editing): its BeforeDenoisingStage, the shared stages'
callbacks, defaults.

Mirrors diffusers' `Flux2Pipeline.__call__` (and `Flux2KleinPipeline`'s: the same but the guidance part,
`guidance.py`) up to the denoising loop: prompt encoding is the pipeline's own `encode_prompt` (hidden states
of three text-encoder layers, with 4-axis text ids), latents and their ids its `prepare_latents` (noise drawn
2x2-patchified in the text embeddings' dtype, one token per latent pixel), timesteps its sigmas shifted by
BFL's empirical mu of the token and step counts. Decoding: the tokens scattered back by their ids, the VAE's
batch-norm statistics undone, unpatchified (the pipeline's own operations before `vae.decode`).

Reference images (`image`, any number): sized as the pipelines size them (`reference_size`: over 1024 x 1024
pixels scaled down to that area, then cropped to multiples of VAE x 2), encoded by their `prepare_image_latents`
(the posterior's mode, normalized, each image's tokens at its own time offset 10, 20, ...) and appended after
the latents' tokens (the reference-tokens part); the prediction of the latents' tokens is kept. With no size
given, the output takes the first image's (else the pipeline's default), as the pipelines do.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.family import import_object
from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.flux2 import KLEIN_OPTIONS, OPTIONS
from spindle.models.flux2.guidance import EMBEDDED_GUIDANCE, KLEIN_GUIDANCE, Guidance
from spindle.models.shared.inference import (
    PackedImageInference,
    PipelineBeforeDenoisingStage,
    check_packed_image_request,
)
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS

MAX_SEQUENCE_LENGTH = 512  # both pipelines' tokenizer_max_length
REFERENCE_AREA = 1024 * 1024  # the pipelines scale a larger reference image down to this many pixels


def reference_size(image: Any, multiple: int) -> tuple[int, int]:
    """The (height, width) the pipelines give a reference image: scaled to REFERENCE_AREA pixels when larger
    (`_resize_to_target_area`'s rounding), then each side rounded down to `multiple` (VAE x 2)."""
    width, height = image.width, image.height
    if width * height > REFERENCE_AREA:
        scale = (REFERENCE_AREA / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    return height // multiple * multiple, width // multiple * multiple


class Flux2BeforeDenoisingStage(PipelineBeforeDenoisingStage):
    pipeline_class = "diffusers:Flux2Pipeline"
    scheduler_may_own_sigmas = True  # the pipelines: a scheduler with use_flow_sigmas picks its own
    guidance: Guidance = EMBEDDED_GUIDANCE

    @property
    def distilled(self) -> bool:
        """A step-distilled Klein checkpoint (`is_distilled` in model_index.json): no CFG."""
        return bool(getattr(self.text_pipe.config, "is_distilled", False))

    def validate(self, params: SamplingParams) -> None:
        multiple = 2 * self.vae_scale_factor
        for image in params.image or []:  # the pipelines' own checks (at least 64 pixels a side, aspect <= 8)
            try:
                self.text_pipe.image_processor.check_image_input(image)
            except ValueError as e:
                raise RequestError(f"image: {e}", field="image") from None
        if params.image and (params.height is None or params.width is None):  # the first image's size, as they do
            height, width = reference_size(params.image[0], multiple)
            params.height, params.width = params.height or height, params.width or width
        params.height = params.height or 128 * self.vae_scale_factor  # the pipelines' default_sample_size
        params.width = params.width or 128 * self.vae_scale_factor
        super().validate(params)
        check_packed_image_request(params, self.vae_scale_factor, MAX_SEQUENCE_LENGTH, self.guidance.label)
        self.guidance.check(params, self.distilled)
        # No positional-range check: Flux2PosEmbed computes each rotary angle from the position id (no table).
        # Prompts past max_sequence_length tokens (system message included) are truncated, as the pipelines do.

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        return (
            p.batch_size,
            self.transformer.config.in_channels // 4,  # 2x2-patchified in the transformer's input
            resolved(p.height, "height") // self.vae_scale_factor,
            resolved(p.width, "width") // self.vae_scale_factor,
        )

    def schedule_mu(self, image_seq_len: int, steps: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        return compute_empirical_mu(image_seq_len=image_seq_len, num_steps=steps)

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, text_ids = self.text_pipe.encode_prompt(
            prompt=prompts,
            device=device,
            num_images_per_prompt=p.num_outputs_per_prompt,
            max_sequence_length=p.max_sequence_length,
        )
        return embeds, text_ids

    def forward(self, req: Req) -> Req:
        p = req.params
        device = req.device
        req.model_dtype = self.transformer.dtype
        req.do_cfg = self.guidance.cfg(p, self.distilled)
        scale = float(resolved(p.guidance_scale, "guidance_scale"))
        req.cfg_scale = scale  # the scale the shared DenoisingStage combines with (when CFG runs)
        embeds, text_ids = self.encode(p.prompts, p, device)
        req.prompt_embeds = embeds.to(req.model_dtype)
        req.extra["txt_ids"] = text_ids
        if req.do_cfg:  # Flux2KleinPipeline's negative prompt is "" (a given negative_prompt replaces it)
            negative = "" if p.negative_prompt is None else p.negative_prompt
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            neg_embeds, neg_ids = self.encode(negative, p, device)
            req.negative_prompt_embeds = neg_embeds.to(req.model_dtype)
            req.extra["negative_txt_ids"] = neg_ids
        channels = self.transformer.config.in_channels // 4
        size = resolved(p.height, "height"), resolved(p.width, "width")
        latents, latent_ids = self.text_pipe.prepare_latents(
            p.batch_size, channels, *size, embeds.dtype, device, req.generator
        )
        req.latents = latents
        req.extra["latent_ids"] = req.extra["img_ids"] = latent_ids
        vae = self.text_pipe.vae  # its batch-norm statistics, which decoding undoes (`post_denoising`)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        req.extra["latents_bn"] = (vae.bn.running_mean.view(1, -1, 1, 1), std)
        self.set_references(req)
        req.raw_latent_shape = self.latent_shape(p)
        if self.guidance.embedded:  # Flux2Pipeline gives the embedded guidance whatever the transformer's config
            req.embedded_guidance = torch.full([1], scale, device=device, dtype=torch.float32).expand(latents.shape[0])
        self.set_timesteps(req, device)
        return req

    def set_references(self, req: Req) -> None:
        """The reference images' packed latents (`req.extra["image_latents"]`) and their ids after the latents'
        (`img_ids`), by the pipeline's `prepare_image_latents`, from the images sized and preprocessed as it does."""
        p = req.params
        if not p.image:
            return
        processor = self.text_pipe.image_processor
        pixels = []
        for image in p.image:
            height, width = reference_size(image, 2 * self.vae_scale_factor)
            if image.width * image.height > REFERENCE_AREA:
                image = processor._resize_to_target_area(image, REFERENCE_AREA)
            pixels.append(processor.preprocess(image, height=height, width=width, resize_mode="crop"))
        vae = self.text_pipe.vae
        references, ids = self.text_pipe.prepare_image_latents(
            pixels, p.batch_size, req.generator, req.device, vae.dtype
        )
        req.extra["image_latents"] = references
        req.extra["img_ids"] = torch.cat([req.extra["latent_ids"], ids], dim=1)


class Flux2Inference(PackedImageInference):
    options = OPTIONS
    family = "flux2"
    pipeline_class = Flux2BeforeDenoisingStage.pipeline_class
    components = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    # FLUX.2-dev's PixtralProcessor cannot be built here: its tokenizer (processor.py); Klein's read the same way
    component_loaders = {"tokenizer": "spindle.models.flux2.processor:load_tokenizer"}
    before_denoising_cls = Flux2BeforeDenoisingStage
    reference_tokens = REFERENCE_TOKENS  # the reference images' tokens after the latents'

    def cache_unavailable(self, name: str) -> str | None:
        if name == "fbc":  # diffusers' hooks: the tail's residual is taken against the head block's output
            return (
                f"cache 'fbc' takes the last block's residual against the first block's output, but {self.family}'s "
                "last (single-stream) block returns the text and image tokens joined, not the first (double-stream) "
                "block's pair; use mag, taylorseer or pab"
            )
        return None

    def pipeline_defaults(self, components: dict[str, Any]) -> SamplingParams:
        # both pipelines' __call__ defaults: 128 latent pixels x VAE factor (no input image), 50 steps, guidance 4
        size = 128 * 2 ** (len(components["vae"].config.block_out_channels) - 1)
        return SamplingParams(
            negative_prompt=None,
            height=size,
            width=size,
            num_inference_steps=50,
            guidance_scale=4.0,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        x = req.extra
        return {
            **self.packed_kwargs(req, latents, t, branch),
            "txt_ids": x["txt_ids"] if branch == "cond" else x["negative_txt_ids"],
            "img_ids": x["img_ids"],
            "joint_attention_kwargs": None,
        }

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        tokens = super().sequence_length(req, transformer)
        references = req.extra.get("image_latents")
        if references is not None:
            return tokens + references.shape[1]
        vae_factor = resolved(req.params.height, "height") // resolved(req.raw_latent_shape, "raw_latent_shape")[-2]
        for image in req.params.image or []:  # before the stage ran: the tokens its sizing gives
            height, width = reference_size(image, 2 * vae_factor)
            tokens += (height // (2 * vae_factor)) * (width // (2 * vae_factor))
        return tokens

    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        """Tokens [B, S, 4c] -> the VAE layout [B, c, h, w], as the pipeline does it: scattered by their ids, the
        batch-norm statistics undone (per patchified channel), unpatchified."""
        pipeline = import_object(self.pipeline_class)
        unpacked = pipeline._unpack_latents_with_ids(latents, req.extra["latent_ids"])
        mean, std = (x.to(unpacked.device, unpacked.dtype) for x in req.extra["latents_bn"])
        unpatchified: torch.Tensor = pipeline._unpatchify_latents(unpacked * std + mean)
        return unpatchified

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[float, float]:
        return 1.0, 0.0  # the latents are the VAE's own already (post_denoising)


class Flux2KleinBeforeDenoisingStage(Flux2BeforeDenoisingStage):
    pipeline_class = "diffusers:Flux2KleinPipeline"
    guidance = KLEIN_GUIDANCE


class Flux2KleinInference(Flux2Inference):
    """FLUX.2's spec with Klein's pipeline and guidance part (its `is_distilled` passed to the pipeline)."""

    options = KLEIN_OPTIONS
    family = "flux2_klein"
    pipeline_class = Flux2KleinBeforeDenoisingStage.pipeline_class
    pipeline_config = KLEIN_GUIDANCE.pipeline_config
    before_denoising_cls = Flux2KleinBeforeDenoisingStage


INFERENCE = Flux2Inference()
KLEIN_INFERENCE = Flux2KleinInference()
