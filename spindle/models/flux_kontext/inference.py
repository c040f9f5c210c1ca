"""FLUX.1 Kontext inference: Flux's BeforeDenoisingStage plus the source image and the pipeline's sizing.

Mirrors diffusers' `FluxKontextPipeline.__call__` up to the denoising loop: the prompts as Flux's, the
source image resized as the pipeline resizes it (`reference_size`: its own size or, with `auto_resize`,
the preferred Kontext resolution nearest its aspect ratio), preprocessed by the pipeline's image
processor and VAE-encoded by its `_encode_vae_image`, then its own `prepare_latents` (noise from the
request's generator, the packed reference latents and their ids, offset to 1 on the first axis).
Each step the transformer sees [latents, reference latents] on the token axis, and the prediction
of the latents' tokens is kept (`target_prediction`), as the pipeline keeps `noise_pred[:, :S]`.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.flux.inference import FluxBeforeDenoisingStage, FluxInference
from spindle.models.flux_kontext import OPTIONS
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS


def output_size(height: int, width: int, max_area: int, multiple: int) -> tuple[int, int]:
    """FluxKontextPipeline's output size: height x width scaled to `max_area` pixels at its aspect ratio,
    each side rounded down to `multiple` (VAE factor x 2)."""
    aspect = width / height
    fitted_width = round((max_area * aspect) ** 0.5) // multiple * multiple
    fitted_height = round((max_area / aspect) ** 0.5) // multiple * multiple
    return fitted_height, fitted_width


def reference_size(image: Any, auto_resize: bool, multiple: int) -> tuple[int, int]:
    """FluxKontextPipeline's size for the source image: its own (rounded down to `multiple`) or, with
    `auto_resize`, the preferred Kontext resolution nearest its aspect ratio."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    height, width = image.height // multiple * multiple, image.width // multiple * multiple
    if auto_resize and height and width:
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return height // multiple * multiple, width // multiple * multiple


class FluxKontextBeforeDenoisingStage(FluxBeforeDenoisingStage):
    pipeline_class = "diffusers:FluxKontextPipeline"

    @property
    def multiple(self) -> int:
        return 2 * self.vae_scale_factor  # VAE downsampling x 2x2 packing

    def validate(self, params: SamplingParams) -> None:
        if params.height is None and params.width is None:
            # no size asked: the pipeline's own (its default 128 latent pixels x the VAE factor, fitted to
            # max_area), so the defaults generate what FluxKontextPipeline(prompt, image) does
            default = 128 * self.vae_scale_factor
            params.height, params.width = output_size(default, default, int(params.extra["max_area"]), self.multiple)
        elif params.height is None or params.width is None:  # one side given: the other the pipeline's default
            params.height = params.height or 128 * self.vae_scale_factor
            params.width = params.width or 128 * self.vae_scale_factor
        super().validate(params)
        height, width = resolved(params.height, "height"), resolved(params.width, "width")
        max_area = int(params.extra["max_area"])
        fitted = output_size(height, width, max_area, self.multiple)
        if fitted != (height, width):
            h, w = fitted
            raise RequestError(
                f"max_area={max_area}: FluxKontextPipeline would generate {h}x{w}, not the asked {height}x{width} "
                f"(it scales height x width to max_area pixels); give max_area={height * width} to keep "
                f"{height}x{width}, or ask height={h}, width={w}",
                field="max_area",
            )
        for image in params.image or []:
            size = reference_size(image, bool(params.extra["auto_resize"]), self.multiple)
            if not all(size):
                raise RequestError(
                    f"image is {image.width}x{image.height} pixels: FluxKontextPipeline needs at least "
                    f"{self.multiple} on each side (VAE x{self.vae_scale_factor} x 2x2 packing)",
                    field="image",
                )

    def source_pixels(self, p: SamplingParams) -> torch.Tensor | None:
        """The source image as FluxKontextPipeline preprocesses it: [1, 3, h, w] in [-1, 1], or None."""
        if not p.image:
            return None
        image = p.image[0]
        height, width = reference_size(image, bool(p.extra["auto_resize"]), self.multiple)
        processor = self.text_pipe.image_processor
        resized = processor.resize(image, height, width)
        pixels: torch.Tensor = processor.preprocess(resized, height, width)
        return pixels

    def set_latents(self, req: Req) -> None:
        p = req.params
        pipe = self.text_pipe
        pixels = self.source_pixels(p)
        image_latents = None
        if pixels is not None:  # encoded in the VAE's dtype; the latents stay float32 as the noise
            vae = pipe.vae
            pixels = pixels.to(req.device, vae.dtype)
            image_latents = pipe._encode_vae_image(pixels, generator=req.generator).to(torch.float32)
        latents, packed_image, latent_ids, image_ids = pipe.prepare_latents(image_latents, *self.latent_args(req))
        if image_ids is not None:
            latent_ids = torch.cat([latent_ids, image_ids], dim=0)  # the sequence axis, as the pipeline
            req.extra["image_latents"] = packed_image.to(req.model_dtype)
        req.latents = latents
        req.extra["img_ids"] = latent_ids.to(req.model_dtype)
        req.raw_latent_shape = self.latent_shape(p)


class FluxKontextInference(FluxInference):
    """Flux's spec with the reference-tokens part: FluxPipeline's defaults, the size left to max_area (the stage);
    the source's tokens appended."""

    options = OPTIONS
    family = "flux_kontext"
    pipeline_class = FluxKontextBeforeDenoisingStage.pipeline_class
    before_denoising_cls = FluxKontextBeforeDenoisingStage
    reference_tokens = REFERENCE_TOKENS

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        tokens = super().sequence_length(req, transformer)
        reference = req.extra.get("image_latents")
        if reference is not None:
            return tokens + reference.shape[1]
        vae_factor = resolved(req.params.height, "height") // resolved(req.raw_latent_shape, "raw_latent_shape")[-2]
        for image in req.params.image or []:  # before the stage ran: the tokens its sizing gives
            height, width = reference_size(image, bool(req.params.extra["auto_resize"]), 2 * vae_factor)
            tokens += (height // (2 * vae_factor)) * (width // (2 * vae_factor))
        return tokens


INFERENCE = FluxKontextInference()
