"""Wan2.2 TI2V-5B inference: Wan's stages with `expand_timesteps` (`WanPipeline` / `WanImageToVideoPipeline`
with `expand_timesteps=True`, which differ from Wan2.1's in the denoising loop only).

Each step the transformer gets one timestep per latent token, `(mask[0][0][:, ::2, ::2] * t).flatten()`,
with the mask all ones (text-to-video) or zero on the first latent frame (image-to-video: that frame is the
VAE-encoded image, put back into the latents before every step and before decoding)."""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.request import Req, resolved
from spindle.models.wan.inference import WanBeforeDenoisingStage, WanInference
from spindle.models.wan22_ti2v import OPTIONS


class Wan22TI2VBeforeDenoisingStage(WanBeforeDenoisingStage):
    def make_reference_pipe(self, components: dict[str, Any]) -> Any:
        from diffusers import WanImageToVideoPipeline

        # the image-to-video pipeline on the same folder (as stock users load it): its prompt encoding is
        # WanPipeline's, its prepare_latents builds the first-frame condition and mask
        return self.reference_pipe(WanImageToVideoPipeline, components, expand_timesteps=True)

    def forward(self, req: Req) -> Req:
        req = super().forward(req)  # prompts, scheduler, timesteps, the noise (req.latents)
        latents = resolved(req.latents, "latents")
        p = req.params
        if not p.image:  # text-to-video: WanPipeline's all-ones mask
            req.extra["mask"] = torch.ones((1, 1, *latents.shape[2:]), dtype=torch.float32, device=req.device)
            return req
        latents, condition, mask = self.image_latents(req, p.image[0])
        req.latents = latents
        req.extra.update(condition=condition, mask=mask)
        return req


class Wan22TI2VInference(WanInference):
    options = OPTIONS
    family = "wan22_ti2v"
    before_denoising_cls = Wan22TI2VBeforeDenoisingStage

    def check_checkpoint(self, model_index: dict[str, Any]) -> None:
        self.check_experts(model_index)  # one transformer: a two-expert folder is wan22's
        if not model_index.get("expand_timesteps"):
            raise ValueError(
                "wan22_ti2v serves Wan2.2 TI2V-5B folders (expand_timesteps in model_index.json); this one has none: "
                "load it as its own family (remove model.family)"
            )

    @staticmethod
    def with_condition(latents: torch.Tensor, req: Req) -> torch.Tensor:
        """The latents with the first frame replaced by the image's (image-to-video), as the pipeline does."""
        condition, mask = req.extra.get("condition"), req.extra["mask"]
        return latents if condition is None else (1 - mask) * condition + mask * latents

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        kwargs = super().denoiser_kwargs(req, latents, t, branch)
        kwargs["hidden_states"] = self.with_condition(latents, req).to(req.model_dtype)
        # the pipelines' per-token timestep; their `::2` is the transformer's 2x2 patch
        per_token = (req.extra["mask"][0][0][:, ::2, ::2] * t).flatten()
        kwargs["timestep"] = per_token.unsqueeze(0).expand(latents.shape[0], -1)
        return kwargs

    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        return self.with_condition(latents, req)


INFERENCE = Wan22TI2VInference()
