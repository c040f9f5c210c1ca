"""FLUX.1 Kontext's frozen condition components: Flux's, plus the source image of an edit pair encoded as
`FluxKontextPipeline` encodes the image it edits.

A sample's source (`batch["images"]` [B, 1, 3, H, W] in [-1, 1], spindle.data.edit_pairs; resized as the
target) goes through the pipeline's `_encode_vae_image` (the posterior's mode, Flux's shift/scale) and is
kept in the VAE layout (precomputable). The training inputs append its packed tokens to the noisy
latents' with the pipeline's reference ids (first axis 1), and the loss reads the prediction of the
target's tokens only (`target_prediction`), as the pipeline keeps `noise_pred[:, :S]`. The sigma shift
counts the target's tokens, as the pipeline's `mu` does. A sample without a source trains Kontext's
text-to-image mode (no reference tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.models.flux.condition import FluxConditionModel
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS


class FluxKontextConditionModel(FluxConditionModel):
    pipeline_class = "diffusers:FluxKontextPipeline"
    label = "FLUX.1 Kontext"
    reference_tokens = REFERENCE_TOKENS  # the source's tokens after the target's; the loss on the target's

    @torch.no_grad()
    def encode_sources(self, images: torch.Tensor) -> torch.Tensor:
        """Source images [B, 1, 3, H, W] in [-1, 1] -> normalized reference latents [B, c, H/s, W/s]."""
        if images.ndim != 5 or images.shape[1] != 1:
            raise ValueError(
                f"FLUX.1 Kontext edits one source image per sample; got source images of shape "
                f'{tuple(images.shape)} ([B, N, 3, H, W]); give each edit pair a single "image"'
            )
        pixels = images[:, 0]
        self.check_pixel_shape(pixels.shape)
        return self.pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        conditions = super().encode(batch)
        if "images" in batch:
            conditions["image_latents"] = self.encode_sources(batch["images"])
        return conditions

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        inputs = super().training_inputs(conditions, generators)
        reference = conditions.get("image_latents")
        if reference is None:
            return inputs
        noisy = inputs["hidden_states"]
        b, _, h, w = reference.shape
        ids = self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, noisy.device, noisy.dtype)
        ids[..., 0] = 1  # the pipeline's reference ids: the latents' grid, offset on the first axis
        inputs["hidden_states"] = REFERENCE_TOKENS.append(noisy, [self.pack(reference.to(noisy))])
        inputs["img_ids"] = torch.cat([inputs["img_ids"], ids], dim=0)
        return inputs


CONDITION_MODEL = FluxKontextConditionModel  # the family's condition model (DiTFamily finds it by this name)
