"""LTX-2 image-to-video's condition model: text-to-video's (video-only with the audio stream noise at sigma 1, or
with each clip's sound under `data.audio`) plus the conditioning image, as `LTX2ImageToVideoPipeline` uses it at
inference.

The conditioning image of a sample is the clip's first frame, or the file its manifest entry names (`"image"`; the
loader puts it in `batch["image"]`), at the clip's size. It goes through the pipeline's own code as the uint8 RGB
image a user would pass: re-compressed as one H.264 frame at the pipeline's default CRF (33), its video processor,
the VAE's mode of it alone (a one-frame video), normalised. That is the first latent frame of the transformer's
input, with timestep 0 on its tokens (the rest the sample's), and the loss leaves those tokens out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.data.media import tensor_to_image
from spindle.models.ltx2.condition import LTX2ConditionModel
from spindle.models.ltx2_i2v import IMAGE_CRF


class LTX2I2VConditionModel(LTX2ConditionModel):
    pipeline_class = "diffusers:LTX2ImageToVideoPipeline"
    label = "LTX-2 I2V"

    @torch.no_grad()
    def encode_first_frames(self, images: torch.Tensor) -> torch.Tensor:
        """Conditioning images [B, 3, H, W] in [-1, 1] -> the normalised first latent frames [B, C, 1, h, w]."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from PIL import Image

        pipe, vae = self.pipe, self.pipe.vae
        height, width = images.shape[-2:]
        frames = [
            Image.fromarray(apply_image_conditioning_crf(np.array(tensor_to_image(image)), IMAGE_CRF.default))
            for image in images
        ]
        pixels = torch.cat([pipe.video_processor.preprocess(f, height=height, width=width) for f in frames])
        latents = self.vae_latents(pixels.unsqueeze(2))
        return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std).to(self.dtype)

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        conditions = super().encode(batch)  # checks the pixel shape first
        images = batch.get("image")
        if images is None:  # the default conditioning image: each clip's first frame
            images = batch["pixels"][:, :, 0]
        return {**conditions, "first_frame": self.encode_first_frames(images)}

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        inputs = super().training_inputs(conditions, generators)
        noisy = inputs["hidden_states"]
        first = self.pipe._pack_latents(conditions["first_frame"].to(noisy))  # [B, h * w, C]: the first frame's tokens
        tokens = first.shape[1]
        mask = torch.zeros(noisy.shape[:2], dtype=noisy.dtype, device=noisy.device)
        mask[:, :tokens] = 1  # the pipeline's conditioning mask (packed frames come first-frame first)
        inputs["hidden_states"] = torch.cat([first, noisy[:, tokens:]], dim=1)
        inputs["timestep"] = inputs["timestep"][:, None] * (1 - mask)
        inputs["loss_mask"] = (1 - mask)[..., None]
        return inputs


CONDITION_MODEL = LTX2I2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
