"""Wan2.2 TI2V-5B's condition model: Wan's (the Wan2.2 VAE's latents, normalized by its channel stats), text-to-
video, or image-to-video for a batch that carries conditioning images (a manifest naming `"image"`; lines
without one condition on their clip's first frame).

Text-to-video: one timestep per sample (the text-to-video pipeline's per-token timestep is that value at
every token). Image-to-video, as `WanImageToVideoPipeline` with `expand_timesteps` denoises: the first latent
frame is the VAE-encoded image (the image alone, as a one-frame video, normalized as `prepare_latents` does),
its tokens get timestep 0 and the rest the sample's; the loss leaves that clean frame out.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.data.media import tensor_to_image
from spindle.models.wan.condition import WanConditionModel


class Wan22TI2VConditionModel(WanConditionModel):
    @torch.no_grad()
    def encode_first_frames(self, images: torch.Tensor) -> torch.Tensor:
        """Conditioning images [B, 3, H, W] in [-1, 1] -> the first latent frames [B, z, 1, h, w], computed as
        `WanImageToVideoPipeline.prepare_latents` computes its condition (uint8 image, its video processor,
        the VAE's mode, `(latents - mean) * (1 / std)`)."""
        height, width = images.shape[-2:]
        pixels = torch.cat(
            [self.pipe.video_processor.preprocess(tensor_to_image(f), height=height, width=width) for f in images]
        )
        latents = self.vae_latents(pixels.unsqueeze(2)).float()
        mean, std = self.latents_mean.to(latents), self.latents_std.to(latents)
        return ((latents - mean) * (1.0 / std)).to(self.dtype)

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        conditions = super().encode(batch)  # checks the pixel shape first
        if batch.get("image") is not None:
            conditions["first_frame"] = self.encode_first_frames(batch["image"])
        return conditions

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        inputs = super().training_inputs(conditions, generators)
        if "first_frame" not in conditions:
            return inputs
        noisy = inputs["hidden_states"]
        mask = torch.ones((1, 1, *noisy.shape[2:]), dtype=noisy.dtype, device=noisy.device)
        mask[:, :, 0] = 0  # the pipeline's first_frame_mask
        inputs["hidden_states"] = (1 - mask) * conditions["first_frame"].to(noisy) + mask * noisy
        # per token, as the pipeline: (mask[0][0][:, ::2, ::2] * t).flatten() (`::2`: the 2x2 patch)
        per_token = mask[0][0][:, ::2, ::2].flatten()
        inputs["timestep"] = inputs["timestep"].to(noisy)[:, None] * per_token[None]
        inputs["loss_mask"] = mask
        return inputs


CONDITION_MODEL = Wan22TI2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
