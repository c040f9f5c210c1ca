"""The reference-tokens part of an image-editing family: what FLUX.1 Kontext adds to Flux and Qwen-Image-Edit to
Qwen-Image, by composition. The packed image families' spec (`shared.inference.PackedImageInference`) and
condition model (`shared.condition.PackedImageConditionModel`) hold one (None: text-to-image only) and call it:

- `default_params`: no default size; the edit family's before-denoising stage derives it as its pipeline does
  (from `max_area`, or from the input image);
- `append`: the packed reference (source-image) latents after the noisy latents' tokens, one sequence;
- `prediction`: only the latents' part of the transformer's output, as the pipelines keep
  `noise_pred[:, : latents.size(1)]` (before CFG combines the branches; training's loss likewise).

Where the tokens come from (the VAE encoding, the position ids or `img_shapes`) stays the family's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spindle.contracts.request import SamplingParams


class ReferenceTokens:
    def default_params(self, params: SamplingParams) -> SamplingParams:
        params.height = params.width = None
        return params

    def append(self, latents: torch.Tensor, references: Sequence[torch.Tensor]) -> torch.Tensor:
        """[B, S, C] latents tokens, then each [B, S_i, C] reference's, on the sequence axis (in the latents' dtype)."""
        if not references:
            return latents
        return torch.cat([latents, *(r.to(latents.dtype) for r in references)], dim=1)

    def prediction(self, pred: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The output at the latents' tokens (the first `latents.shape[1]`); the references' are dropped."""
        return pred[:, : latents.shape[1]]


REFERENCE_TOKENS = ReferenceTokens()
