"""Qwen-Image-Edit's frozen condition components (training): Qwen-Image's (models/qwenimage/condition.py)
plus the source images of each edit pair, encoded as `QwenImageEditPipeline` /
`QwenImageEditPlusPipeline` encode their input images.

A batch carries the target in `pixels` and the sources in `images` [B, N, 3, H, W] (the same value
range, resized and cropped to the sample's resolution by the loader); `image` [B, 3, H, W] (a manifest's
single conditioning image) is taken as N = 1. Per sample:

- the instruction goes through the pipeline's own `encode_prompt` *with* the source image(s) as uint8
  PIL images (what a user passes): the chat template's vision placeholder(s), expanded by the processor,
  filled by the text encoder's vision tower. Edit shows the vision tower the image at the size the VAE
  encodes it; Plus each image sized to `condition_image_area` by the pipeline's `calculate_dimensions`.
- the reference latents are the sources' VAE modes, normalized as the pipeline's `_encode_vae_image`,
  stored unpacked [B, N, c, h, w]; `training_inputs` packs each and appends it to the noisy tokens, with
  `img_shapes` listing the target's grid then each source's, and the loss reads only the target's tokens
  (`prediction`).

Training encodes the sources at the sample's resolution (as musubi-tuner and ai-toolkit train edit
LoRAs); the pipelines encode them at `image_area` (1024 x 1024 by default): generate with
`image_area` = the training resolution's area to see the inputs as training did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from spindle.data.media import tensor_to_image
from spindle.models.qwenimage.condition import QwenImageConditionModel, pad_text
from spindle.models.qwenimage_edit import CONDITION_IMAGE_AREA
from spindle.models.qwenimage_edit.inference import image_size
from spindle.models.qwenimage_edit.processor import stock_components
from spindle.models.shared.condition import frames_as_images
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS


class QwenImageEditConditionModel(QwenImageConditionModel):
    pipeline_class = "diffusers:QwenImageEditPipeline"
    label = "Qwen-Image-Edit"
    # the edit pipelines do not truncate: the prompt holds each image's vision tokens (~1300 for a
    # 1024 x 1024 image with Qwen2.5-VL's processor), so the padded length is bounded by memory only
    max_text_limit = 32768
    reference_tokens = REFERENCE_TOKENS  # the sources' tokens after the target's; the loss on the target's

    @classmethod
    def pipeline_overrides(cls, root: str | Path) -> dict[str, Any]:
        return stock_components(root)

    def vision_images(self, images: list[Any]) -> list[Any]:
        """The source images as the text encoder's vision tower sees them (Edit: as given)."""
        return images

    def source_images(self, batch: dict[str, Any], count: int) -> torch.Tensor:
        images = batch.get("images")
        if images is None and batch.get("image") is not None:
            images = batch["image"][:, None]
        if images is None:
            raise ValueError(
                f"{self.label} trains on edit pairs: the batch has no source images (`images`); give each sample "
                "its source image(s) in the dataset manifest"
            )
        if images.ndim != 5 or images.shape[0] != count or images.shape[2] != 3:
            raise ValueError(f"{self.label}: source images must be [B, N, 3, H, W]; got {tuple(images.shape)}")
        return images

    @torch.no_grad()
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        pixels = frames_as_images(batch["pixels"], self.label)
        self.check_pixel_shape(pixels.shape)
        sources = self.source_images(batch, pixels.shape[0])
        self.check_pixel_shape(sources.shape)
        embeds, masks = [], []
        for caption, images in zip(batch["caption"], sources, strict=True):
            pil = [tensor_to_image(image) for image in images]
            e, m = self.pipe.encode_prompt(prompt=[caption], image=self.vision_images(pil), device=self.device)
            if e.shape[1] > self.max_text_length:
                raise ValueError(
                    f"model.max_text_length is {self.max_text_length} but the {self.label} prompt of {caption[:40]!r} "
                    f"is {e.shape[1]} tokens with its image(s)' vision tokens; raise model.max_text_length"
                )
            e, m = pad_text(e.to(self.dtype), m, self.max_text_length)
            embeds.append(e)
            masks.append(m)
        b, n = sources.shape[:2]
        references = self.normalize(sources.flatten(0, 1))
        return {
            "latents": self.normalize(pixels),
            "prompt_embeds": torch.cat(embeds),
            "prompt_embeds_mask": torch.cat(masks),
            "image_latents": references.view(b, n, *references.shape[1:]),
        }

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        inputs = super().training_inputs(conditions, generators)
        noisy = inputs["hidden_states"]
        references = conditions["image_latents"].to(noisy)
        b, n, _, h, w = references.shape
        packed = [self.pack(references[:, i]) for i in range(n)]
        inputs["hidden_states"] = REFERENCE_TOKENS.append(noisy, packed)
        inputs["img_shapes"] = [[*inputs["img_shapes"][0], *[(1, h // 2, w // 2)] * n]] * b
        return inputs


class QwenImageEditPlusConditionModel(QwenImageEditConditionModel):
    pipeline_class = "diffusers:QwenImageEditPlusPipeline"
    label = "Qwen-Image-Edit-Plus"

    def vision_images(self, images: list[Any]) -> list[Any]:
        """Each source sized to the pipeline's condition area (384 x 384), as its `__call__` does."""
        resize = self.pipe.image_processor.resize
        out = []
        for image in images:
            width, height = image_size(image, CONDITION_IMAGE_AREA, self.pipeline_class)
            out.append(resize(image, height, width))
        return out


CONDITION_MODEL = QwenImageEditConditionModel  # the family's condition model (DiTFamily finds it by this name)
