"""HunyuanVideo-1.5 I2V's frozen condition components: the text-to-video family's plus the conditioning image,
encoded as `HunyuanVideo15ImageToVideoPipeline` encodes it at inference.

The conditioning image of a sample is the clip's first frame, or the file its manifest entry names (`"image":
path`; the loader puts it in `batch["image"]`), at the clip's size. It goes through the pipeline's own code as the
uint8 RGB image a user would pass: `encode_image` (the SigLIP last hidden state) and
`prepare_cond_latents_and_mask` (the VAE mode of the image x scaling_factor at frame 0, zeros after, with the
frame mask). Training targets are text-to-video's; the transformer's input is [noisy; condition; mask].
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.data.media import tensor_to_image
from spindle.models.hunyuan_video_1_5.condition import HunyuanVideo15ConditionModel


class HunyuanVideo15I2VConditionModel(HunyuanVideo15ConditionModel):
    pipeline_class = "diffusers:HunyuanVideo15ImageToVideoPipeline"
    label = "HunyuanVideo-1.5 I2V"

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """Conditioning images [B, 3, H, W] in [-1, 1], the clips' latents [B, C, F, h, w] -> {"condition":
        [B, C + 1, F, h, w], "image_embeds": [B, N, D]}, one image per pipeline call."""
        pipe = self.pipe
        height, width = images.shape[-2:]
        conditions, embeds = [], []
        for frame, clip in zip(images, latents, strict=True):
            image = tensor_to_image(frame)
            embeds.append(pipe.encode_image(image, 1, self.device, self.dtype))
            cond, mask = pipe.prepare_cond_latents_and_mask(
                clip[None], image, 1, height, width, self.dtype, self.device
            )
            conditions.append(torch.cat([cond, mask], dim=1))
        return {"condition": torch.cat(conditions), "image_embeds": torch.cat(embeds)}

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        encoded = super().encode(batch)  # checks the pixel shape first
        images = batch.get("image")
        if images is None:  # the default conditioning image: each clip's first frame
            images = batch["pixels"][:, :, 0]
        return {**encoded, **self.encode_images(images, encoded["latents"])}

    def condition(self, x0: torch.Tensor, conditions: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return conditions["condition"].to(x0), conditions["image_embeds"].to(x0)


CONDITION_MODEL = HunyuanVideo15I2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
