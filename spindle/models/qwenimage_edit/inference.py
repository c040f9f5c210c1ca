"""Qwen-Image-Edit inference (diffusers `QwenImageEditPipeline`, `QwenImageEditPlusPipeline`): Qwen-Image's
stages plus the input image(s), encoded as the pipelines encode them.

Mirrors the pipelines' `__call__` up to the denoising loop. Each input image is sized by the pipeline's
own `calculate_dimensions` (aspect ratio kept, sides multiples of 32) to an area: for the VAE,
`image_area` (the pipelines' 1024 x 1024); for the vision-language text encoder, the same image
(Edit) or `condition_image_area` (Plus: 384 x 384). The prompt goes through the pipeline's own
`encode_prompt` with the image(s) (the chat template holds a vision placeholder per image, which the
processor expands to the image's tokens and the text encoder's vision tower fills), the reference
latents through its `prepare_latents` (VAE mode, normalized, 2x2-packed) after the noise is drawn in
the same order. Each step the transformer sees [noisy latents; reference latents] as one token
sequence, with `img_shapes` listing the output's grid then each reference's, and only the first
tokens of its output predict the latents (`prediction`). An unset `size` is the (last, for Plus)
input image's VAE size, as in the pipelines.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.family import import_object
from spindle.contracts.request import Req, SamplingParams, resolved
from spindle.models.qwenimage.condition import pad_text
from spindle.models.qwenimage.inference import QwenImageBeforeDenoisingStage, QwenImageInference
from spindle.models.qwenimage_edit import OPTIONS, PLUS_OPTIONS
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS


def image_size(image: Any, area: int, pipeline_class: str) -> tuple[int, int]:
    """(width, height) the pipeline sizes `image` to for `area` pixels: its `calculate_dimensions`."""
    module = import_object(pipeline_class).__module__
    calculate = import_object(f"{module}:calculate_dimensions")
    width, height = calculate(area, image.width / image.height)[:2]
    return int(width), int(height)


class QwenImageEditBeforeDenoisingStage(QwenImageBeforeDenoisingStage):
    pipeline_class = "diffusers:QwenImageEditPipeline"
    size_image = 0  # which input image an unset size follows (QwenImageEditPipeline: the first)

    def vae_sizes(self, params: SamplingParams) -> list[tuple[int, int]]:
        """(width, height) of each input image as the VAE encodes it."""
        area = int(params.extra["image_area"])
        return [image_size(image, area, self.pipeline_class) for image in resolved(params.image, "image")]

    def validate(self, params: SamplingParams) -> None:
        if params.image and (params.height is None or params.width is None):
            # the pipeline's size: the input image's VAE size, floored to the VAE x 2 multiple (as it does)
            width, height = self.vae_sizes(params)[self.size_image]
            multiple = 2 * self.vae_scale_factor
            params.height = params.height or height // multiple * multiple
            params.width = params.width or width // multiple * multiple
        super().validate(params)

    def condition_images(self, params: SamplingParams) -> list[Any]:
        """The images the vision-language text encoder sees (PIL): here the VAE-sized one."""
        (width, height), image = self.vae_sizes(params)[0], resolved(params.image, "image")[0]
        return [self.text_pipe.image_processor.resize(image, height, width)]

    def vae_pixels(self, params: SamplingParams) -> Any:
        """What the pipeline hands `prepare_latents`: [1, 3, 1, H, W] of the resized image, in [-1, 1]."""
        (width, height), resized = self.vae_sizes(params)[0], self.condition_images(params)[0]
        return self.text_pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device, dtype: torch.dtype):
        """The pipeline's `encode_prompt` with the input images (as PIL images, as it passes them), one prompt
        at a time (the template holds one set of vision placeholders; the pipelines take one prompt), then
        padded to one length with masked zeros as `encode_prompt` pads a batch (mask None: all valid)."""
        images = self.condition_images(p)
        parts = [
            self.text_pipe.encode_prompt(
                prompt=[text],
                image=images,
                device=device,
                num_images_per_prompt=p.num_outputs_per_prompt,
                max_sequence_length=p.max_sequence_length,
            )
            for text in prompts
        ]
        if len(parts) == 1:
            embeds, mask = parts[0]
        else:
            length = max(e.shape[1] for e, _ in parts)
            padded = [pad_text(e, m, length) for e, m in parts]
            embeds, mask = torch.cat([e for e, _ in padded]), torch.cat([m for _, m in padded])
            mask = None if bool(mask.all()) else mask
        return embeds.to(dtype), mask

    def prepare_latents(self, req: Req) -> torch.Tensor:
        """The noise and the reference latents (`req.extra["image_latents"]`, packed) by the pipeline's own
        `prepare_latents`: the VAE mode draws nothing, so the noise is the pipeline's draw."""
        latents, req.extra["image_latents"] = self.text_pipe.prepare_latents(
            self.vae_pixels(req.params), *self.latent_args(req)
        )
        return latents

    def img_shapes(self, p: SamplingParams) -> list[tuple[int, int, int]]:
        """The output's packed grid, then each reference image's (its VAE size / VAE factor / 2)."""
        scale = 2 * self.vae_scale_factor
        return [*super().img_shapes(p), *[(1, h // scale, w // scale) for w, h in self.vae_sizes(p)]]


class QwenImageEditPlusBeforeDenoisingStage(QwenImageEditBeforeDenoisingStage):
    pipeline_class = "diffusers:QwenImageEditPlusPipeline"
    size_image = -1  # QwenImageEditPlusPipeline: an unset size follows the last image

    def condition_images(self, params: SamplingParams) -> list[Any]:
        area = int(params.extra["condition_image_area"])
        resize = self.text_pipe.image_processor.resize
        out = []
        for image in resolved(params.image, "image"):
            width, height = image_size(image, area, self.pipeline_class)
            out.append(resize(image, height, width))
        return out

    def vae_pixels(self, params: SamplingParams) -> Any:
        preprocess = self.text_pipe.image_processor.preprocess
        images = resolved(params.image, "image")
        return [preprocess(im, h, w).unsqueeze(2) for im, (w, h) in zip(images, self.vae_sizes(params), strict=True)]


class QwenImageEditInference(QwenImageInference):
    """Qwen-Image's spec with the reference-tokens part: its defaults, the size left to the input image (the
    stage); the sources' tokens appended."""

    options = OPTIONS
    reference_tokens = REFERENCE_TOKENS
    family = "qwenimage_edit"
    pipeline_class = QwenImageEditBeforeDenoisingStage.pipeline_class
    components = ("tokenizer", "processor", "text_encoder", "vae", "scheduler", "transformer")
    component_loaders = {"processor": "spindle.models.qwenimage_edit.processor:load_processor"}
    before_denoising_cls: type[QwenImageEditBeforeDenoisingStage] = QwenImageEditBeforeDenoisingStage

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        """The output's tokens plus every reference image's (the transformer's one sequence)."""
        tokens = super().sequence_length(req, transformer)
        height = resolved(req.params.height, "height")
        scale = height // resolved(req.raw_latent_shape, "raw_latent_shape")[-2]
        stage = self.before_denoising_cls
        area = int(req.params.extra["image_area"])
        for image in req.params.image or []:
            width, height = image_size(image, area, stage.pipeline_class)
            tokens += (height // scale // 2) * (width // scale // 2)
        return tokens


class QwenImageEditPlusInference(QwenImageEditInference):
    options = PLUS_OPTIONS
    family = "qwenimage_edit_plus"
    pipeline_class = QwenImageEditPlusBeforeDenoisingStage.pipeline_class
    before_denoising_cls = QwenImageEditPlusBeforeDenoisingStage


INFERENCE = QwenImageEditInference()
QWENIMAGE_EDIT_PLUS_INFERENCE = QwenImageEditPlusInference()
