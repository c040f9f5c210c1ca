"""HunyuanVideo-1.5's frozen condition components: the Qwen2.5-VL text encoder + chat-template tokenizer, the ByT5
glyph encoder, the VAE, the scheduler; and the training inputs of its transformer.

Training follows the pipeline's conventions: latents `z * scaling_factor` of the VAE's mode (what the pipeline's
decode undoes; its image-to-video sibling encodes the first frame so), noise and the flow-matching pair in the
VAE layout, the transformer's input [noisy; condition latents; mask] with text-to-video's zero condition and zero
image embeddings (the pipeline's), timestep `sigma * 1000`, and the velocity `noise - x0` as the target (the
transformer predicts what the scheduler steps with). Prompts go through the pipeline's own encoders, the Qwen
text padded to `max_text_length` tokens with its mask (the transformer drops padding by the mask).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.condition import PixelGrid
from spindle.models.hunyuan_video_1_5 import MAX_SEQUENCE_LENGTH
from spindle.models.hunyuan_video_1_5.inference import encode_prompts
from spindle.models.shared.condition import PipelineConditionModel, meta_vae
from spindle.ops.flow_matching import flow_matching_pair, sample_sigmas


def transformer_config(root: str | Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((Path(root) / "transformer" / "config.json").read_text())
    return config


class HunyuanVideo15ConditionModel(PipelineConditionModel):
    pipeline_class = "diffusers:HunyuanVideo15Pipeline"
    label = "HunyuanVideo-1.5"
    max_text_limit = MAX_SEQUENCE_LENGTH  # its pipeline pads every prompt to it

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        super().__init__(pipe, device, dtype, max_text_length)
        self.scale_temporal = pipe.vae_scale_factor_temporal
        self.scale_spatial = pipe.vae_scale_factor_spatial
        self.image_embed_dim = 0  # the transformer's (read_checkpoint)
        self.patch = self.patch_t = 1

    def read_checkpoint(self, root: Path) -> None:
        super().read_checkpoint(root)
        config = transformer_config(root)
        self.image_embed_dim, self.patch, self.patch_t = (
            config["image_embed_dim"],
            config["patch_size"],
            config["patch_size_t"],
        )

    @classmethod
    def pixel_grid(cls, root: str | Path) -> PixelGrid:
        vae = meta_vae(root)
        multiple = vae.spatial_compression_ratio * transformer_config(root)["patch_size"]
        return PixelGrid(multiple, multiple, frame_multiple=vae.temporal_compression_ratio)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask, glyph, glyph_mask = encode_prompts(self.pipe, list(prompts), self.max_text_length, self.device)
        return {
            "prompt_embeds": embeds.to(self.dtype),
            "prompt_mask": mask,
            "glyph_embeds": glyph.to(self.dtype),
            "glyph_mask": glyph_mask,
        }

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] in [-1, 1] -> the VAE mode's latents x scaling_factor (deterministic)."""
        _, _, frames, height, width = pixels.shape
        multiple = self.scale_spatial * self.patch
        if (frames - 1) % self.scale_temporal:
            raise ValueError(f"{self.label} needs num_frames = {self.scale_temporal}k+1 (1, 5, 9, ...); got {frames}")
        if height % multiple or width % multiple:
            raise ValueError(f"{self.label} needs height and width divisible by {multiple}; got {height}x{width}")
        return self.vae_latents(pixels) * self.pipe.vae.config.scaling_factor

    @torch.no_grad()
    def vae_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """The VAE mode, one video at a time: diffusers' AutoencoderKLHunyuanVideo15 mid-block attention builds its
        causal mask for one video (a batch of several fails in its attention)."""
        one = super().vae_latents
        return torch.cat([one(video[None]) for video in pixels])

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"latents": self.encode_pixels(batch["pixels"]), **self.encode_prompts(batch["caption"])}

    def condition(self, x0: torch.Tensor, conditions: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(condition latents with their mask [B, C + 1, F, h, w], image embeddings): text-to-video's zeros."""
        b, c, f, h, w = x0.shape
        tokens = self.pipe.vision_num_semantic_tokens
        return x0.new_zeros(b, c + 1, f, h, w), x0.new_zeros(b, tokens, self.image_embed_dim)

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        sigmas = sample_sigmas(self.timestep_sampling, generators, within=self.sigma_range)
        noisy, target = flow_matching_pair(x0, sigmas, generators)
        condition, image_embeds = self.condition(x0, conditions)
        device = x0.device
        return {
            "hidden_states": torch.cat([noisy, condition], dim=1),
            "timestep": (sigmas * self.num_train_timesteps).to(device, x0.dtype),
            "encoder_hidden_states": conditions["prompt_embeds"].to(device),
            "encoder_attention_mask": conditions["prompt_mask"].to(device),
            "encoder_hidden_states_2": conditions["glyph_embeds"].to(device),
            "encoder_attention_mask_2": conditions["glyph_mask"].to(device),
            "image_embeds": image_embeds,
            "target": target,
            "sigmas": sigmas,
        }

    def tokens_per_sample(self, inputs: dict[str, Any]) -> int:
        _, _, f, h, w = inputs["hidden_states"].shape
        return (f // self.patch_t) * (h // self.patch) * (w // self.patch)


CONDITION_MODEL = HunyuanVideo15ConditionModel  # the family's condition model (DiTFamily finds it by this name)
