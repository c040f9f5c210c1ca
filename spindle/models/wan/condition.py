"""Wan's frozen condition components: UMT5 text encoder + tokenizer, Wan VAE, flow-matching scheduler."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.condition import PixelGrid
from spindle.model_index import read_model_index
from spindle.models.shared.condition import PipelineConditionModel, meta_vae
from spindle.models.shared.latents import latent_stats
from spindle.models.wan.parts import ExpertsPart
from spindle.ops.flow_matching import flow_matching_pair, sample_sigmas


class WanConditionModel(PipelineConditionModel):
    # A diffusers WanPipeline without its transformer: we reuse its prompt encoding verbatim so
    # training and inference see exactly the embeddings the reference pipeline would compute.
    pipeline_class = "diffusers:WanPipeline"
    # a variant's experts (Wan2.2 A14B's two: the part its folder supplies, `spindle.models.wan.parts`): which
    # one a run trains and the timesteps it draws; None: one transformer
    experts: ExpertsPart | None = None

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        super().__init__(pipe, device, dtype, max_text_length)
        vae_cfg = pipe.vae.config
        self.latents_mean, self.latents_std = latent_stats(vae_cfg)
        self.scale_factor_temporal = vae_cfg.scale_factor_temporal
        self.scale_factor_spatial = vae_cfg.scale_factor_spatial

    @classmethod
    def trained_component(cls, model_index: dict[str, Any], expert: str | None) -> str:
        if cls.experts is None:
            return super().trained_component(model_index, expert)
        return cls.experts.trained_component(model_index, expert)

    def read_checkpoint(self, root: Path) -> None:
        super().read_checkpoint(root)
        self.model_index = read_model_index(root)  # where the experts split the timesteps (`select_expert`)

    def select_expert(self, expert: str) -> None:
        if self.experts is None:
            super().select_expert(expert)  # refuses it: one transformer
            return
        self.sigma_range = self.experts.sigma_range(self.model_index, expert)

    @classmethod
    def pixel_grid(cls, root: str | Path) -> PixelGrid:
        vae = meta_vae(root).config
        patch = json.loads((Path(root) / "transformer" / "config.json").read_text())["patch_size"]
        spatial = vae.scale_factor_spatial
        return PixelGrid(spatial * patch[1], spatial * patch[2], frame_multiple=vae.scale_factor_temporal)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_text_length,
            device=self.device,
            dtype=self.dtype,
        )
        return embeds

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] in [-1, 1] -> normalized latents (the distribution's mode: deterministic)."""
        self.check_pixel_shape(pixels.shape)
        latents = self.vae_latents(pixels)
        mean, std = self.latents_mean.to(latents), self.latents_std.to(latents)
        return (latents - mean) / std

    def check_pixel_shape(self, shape: torch.Size) -> None:
        _, _, frames, height, width = shape
        multiple = 2 * self.scale_factor_spatial  # VAE downsampling x transformer 2x2 patches
        if (frames - 1) % self.scale_factor_temporal:
            raise ValueError(f"Wan needs num_frames = {self.scale_factor_temporal}k+1 (1, 5, 9, 17, ...); got {frames}")
        if height % multiple or width % multiple:
            raise ValueError(f"Wan needs height and width divisible by {multiple}; got {height}x{width}")

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"latents": self.encode_pixels(batch["pixels"]), "prompt_embeds": self.encode_prompts(batch["caption"])}

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        sigmas = sample_sigmas(self.timestep_sampling, generators, within=self.sigma_range)
        noisy, target = flow_matching_pair(x0, sigmas, generators)
        return {
            "hidden_states": noisy,
            "timestep": (sigmas * self.num_train_timesteps).to(x0.device),
            "encoder_hidden_states": conditions["prompt_embeds"].to(x0.device),
            "target": target,
            "sigmas": sigmas,
        }


CONDITION_MODEL = WanConditionModel  # the family's condition model (DiTFamily finds it by this name)
