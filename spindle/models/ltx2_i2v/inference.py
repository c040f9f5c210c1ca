"""LTX-2 image-to-video inference: the text-to-video stage plus the conditioning first frame.

Mirrors diffusers' `LTX2ImageToVideoPipeline.__call__`: the image is re-compressed as one H.264 frame at `image_crf`
(the pipeline's `apply_image_conditioning_crf`), resized to the request's size by its video processor, and its
`prepare_latents` puts the VAE mode of it (normalised) at the first latent frame, noise elsewhere, with the
conditioning mask. The transformer takes a per-token video timestep, 0 on the first frame (`t x (1 - mask)`), the
audio stream the step's timestep; the step leaves the first frame as it is (its velocity is zeroed after guidance,
so the Euler step keeps it exactly, as the pipeline steps frames 1: only). The rest is text-to-video's.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.ltx2.inference import LTX2BeforeDenoisingStage, LTX2Inference, joined, split
from spindle.models.ltx2_i2v import OPTIONS


class LTX2I2VBeforeDenoisingStage(LTX2BeforeDenoisingStage):
    pipeline_class = "LTX2ImageToVideoPipeline"

    def validate(self, params: SamplingParams) -> None:
        if not params.image:
            raise RequestError(
                "image is required: this is an image-to-video model; give the first frame", field="image"
            )
        super().validate(params)

    def video_latents(self, req: Req, height: int, width: int, frames: int) -> torch.Tensor:
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf
        from PIL import Image

        p, pipe = req.params, self.text_pipe
        image = resolved(p.image, "image")[0].convert("RGB")
        crf = int(p.extra["image_crf"])
        if crf:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image), crf))
        pixels = pipe.video_processor.preprocess(image, height=height, width=width)
        # one image for every video of the request (the stock pipeline broadcasts its one latent frame, and fails on
        # per-video generators, which index the image per video: Flow-GRPO's groups)
        pixels = pixels.to(device=req.device, dtype=self.transformer.dtype).repeat(p.batch_size, 1, 1, 1)
        channels = self.transformer.config.in_channels
        latents, mask = pipe.prepare_latents(
            pixels, p.batch_size, channels, height, width, frames, 0.0, torch.float32, req.device, req.generator
        )
        req.extra["conditioning_mask"] = mask  # [B, Sv]: 1 on the first frame's tokens
        return latents


class LTX2I2VInference(LTX2Inference):
    options = OPTIONS
    family = "ltx2_i2v"
    before_denoising_cls: Any = LTX2I2VBeforeDenoisingStage

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        kwargs = super().denoiser_kwargs(req, latents, t, branch)
        timestep = kwargs["timestep"]
        kwargs["timestep"] = timestep.unsqueeze(-1) * (1 - req.extra["conditioning_mask"])
        kwargs["audio_timestep"] = timestep
        return kwargs

    def guide(
        self, req: Req, latents: torch.Tensor, i: int, preds: dict[str, torch.Tensor], cfg_scale: float
    ) -> torch.Tensor:
        video, audio = split(super().guide(req, latents, i, preds, cfg_scale), req)
        keep = (1 - req.extra["conditioning_mask"]).unsqueeze(-1).to(video)  # the first frame does not move
        return joined(video * keep, audio)


INFERENCE = LTX2I2VInference()
