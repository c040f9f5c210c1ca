"""Flux's frozen condition components: CLIP (pooled) + T5 text encoders, AutoencoderKL, the scheduler.

Training follows diffusers' Flux training conventions (examples/dreambooth/train_dreambooth_flux.py):
latents `(z - shift_factor) * scaling_factor`, noise and flow-matching target in the VAE layout,
then 2x2-packed into the token sequence the transformer takes, with `img_ids`/`txt_ids` and, for
guidance-distilled checkpoints (FLUX.1-dev), the embedded guidance value. Sigmas get Flux's
resolution-dependent shift (mu from the image token count, as FluxPipeline samples) unless the
training config sets a static `train.timestep.shift`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.models.shared.condition import PackedImageConditionModel

# The embedded guidance value used for training guidance-distilled checkpoints (diffusers' Flux
# training scripts default to 3.5, which is also FluxPipeline's default guidance_scale).
TRAIN_GUIDANCE = 3.5


class FluxConditionModel(PackedImageConditionModel):
    pipeline_class = "diffusers:FluxPipeline"
    label = "Flux"
    max_text_limit = 512  # its T5 encoder's

    def __init__(
        self,
        pipe: Any,
        device: torch.device,
        dtype: torch.dtype,
        max_text_length: int = 512,
        guidance_embeds: bool = True,
        guidance: float = TRAIN_GUIDANCE,
    ):
        super().__init__(pipe, device, dtype, max_text_length)
        vae_cfg = pipe.vae.config
        self.scaling_factor = vae_cfg.scaling_factor
        self.shift_factor = vae_cfg.shift_factor or 0.0
        self.vae_scale_factor = pipe.vae_scale_factor
        self.guidance_embeds = guidance_embeds
        self.guidance = guidance

    @classmethod
    def vae_downsampling(cls, vae: Any) -> int:
        return int(2 ** (len(vae.config.block_out_channels) - 1))  # FluxPipeline's vae_scale_factor

    def read_checkpoint(self, root: Path) -> None:
        # The transformer is not loaded here; whether it embeds guidance is in its config.
        tcfg = json.loads((root / "transformer" / "config.json").read_text())
        self.guidance_embeds = bool(tcfg.get("guidance_embeds", False))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            max_sequence_length=self.max_text_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        return (self.vae_latents(pixels) - self.shift_factor) * self.scaling_factor

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        b, _, h, w = x0.shape
        noisy, target, sigmas = self.noisy_pair(x0, generators)
        embeds = conditions["prompt_embeds"].to(x0.device)
        guidance = torch.full((b,), self.guidance, device=x0.device) if self.guidance_embeds else None
        return {
            "hidden_states": self.pack(noisy),
            "timestep": sigmas.to(x0.device, x0.dtype),  # FluxTransformer2DModel scales by 1000 itself
            "guidance": guidance,
            "pooled_projections": conditions["pooled_prompt_embeds"].to(x0.device),
            "encoder_hidden_states": embeds,
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=x0.device, dtype=x0.dtype),
            "img_ids": self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, x0.device, x0.dtype),
            "target": self.pack(target),
            "sigmas": sigmas,
        }


CONDITION_MODEL = FluxConditionModel  # the family's condition model (DiTFamily finds it by this name)
