"""Qwen-Image's frozen condition components: Qwen2.5-VL text encoder + chat-template tokenizer, the
Qwen-Image VAE (a Wan-style 3-D VAE with per-channel latent mean/std), the scheduler.

Training follows diffusers' Qwen-Image training conventions (examples/dreambooth/
train_dreambooth_lora_qwen_image.py): latents `(z - mean) / std` from the VAE (images as one
frame), noise and the flow-matching target in the VAE layout, then 2x2-packed into the token
sequence the transformer takes with `img_shapes`, timestep = sigma (the transformer takes t/1000).
Prompts go through the pipeline's own `encode_prompt` (the chat template, then the hidden states
of the template's system prefix dropped); they are variable-length, so each is padded to
`max_text_length` with a mask (`encoder_hidden_states_mask`): fixed shapes let precomputed
conditions batch together and split evenly under sequence parallelism, and masked padding changes
nothing the transformer computes for the real tokens. Sigmas get the resolution-dependent shift
of the scheduler config (as Flux) unless the training config sets a static shift.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.models.shared.condition import PackedImageConditionModel
from spindle.models.shared.latents import latent_stats

# QwenImagePipeline's prompt limit (`max_sequence_length` must be <= 1024 there).
MAX_SEQUENCE_LENGTH = 1024


def pad_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt embeddings [B, S, D] (+ mask [B, S], None = all valid) -> padded to `length` tokens
    with zeros and a 0 mask; the transformer's joint attention never looks at masked tokens."""
    b, s, d = embeds.shape
    if mask is None:
        mask = torch.ones(b, s, dtype=torch.long, device=embeds.device)
    if s > length:
        raise ValueError(f"prompt embeddings have {s} tokens, more than the {length} to pad to")
    embeds = torch.cat([embeds, embeds.new_zeros(b, length - s, d)], dim=1)
    mask = torch.cat([mask, mask.new_zeros(b, length - s)], dim=1)
    return embeds, mask


class QwenImageConditionModel(PackedImageConditionModel):
    pipeline_class = "diffusers:QwenImagePipeline"
    label = "Qwen-Image"
    max_text_limit = MAX_SEQUENCE_LENGTH  # the longest prompt the pipeline takes, in tokens

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        super().__init__(pipe, device, dtype, max_text_length)
        self.latents_mean, self.latents_std = latent_stats(pipe.vae.config)

    @classmethod
    def vae_downsampling(cls, vae: Any) -> int:
        return int(2 ** len(vae.temperal_downsample))  # QwenImagePipeline's vae_scale_factor

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_text_length
        )
        embeds, mask = pad_text(embeds.to(self.dtype), mask, self.max_text_length)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        latents = self.vae_latents(pixels[:, :, None])  # the VAE is 3-D: an image is one frame
        mean, std = self.latents_mean.to(latents), self.latents_std.to(latents)
        return ((latents - mean) / std)[:, :, 0]

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        b, _, h, w = x0.shape
        # noise [B, C, h, w] has the element order of the pipeline's [B, 1, C, h, w] draw
        noisy, target, sigmas = self.noisy_pair(x0, generators)
        return {
            "hidden_states": self.pack(noisy),
            "timestep": sigmas.to(x0.device, x0.dtype),  # the pipeline passes t / 1000 = sigma
            "encoder_hidden_states": conditions["prompt_embeds"].to(x0.device),
            "encoder_hidden_states_mask": conditions["prompt_embeds_mask"].to(x0.device),
            "img_shapes": [[(1, h // 2, w // 2)]] * b,
            "target": self.pack(target),
            "sigmas": sigmas,
        }


CONDITION_MODEL = QwenImageConditionModel  # the family's condition model (DiTFamily finds it by this name)
