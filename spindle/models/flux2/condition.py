"""FLUX.2's frozen condition components: the text encoder (Mistral3 for FLUX.2-dev, Qwen3 for Klein: the
pipeline's own `encode_prompt`, hidden states of three layers stacked), `AutoencoderKLFlux2`, the scheduler.

Latents as the pipelines make them: the VAE posterior's mode 2x2-patchified into the channels and normalized
by the VAE's batch-norm statistics (the pipeline's `_encode_vae_image`), noise and flow-matching target in
that layout, one token per latent pixel (`_pack_latents`), with the pipeline's 4-axis text and image position
ids. Sigmas get the scheduler's resolution-dependent shift for the token count (as Flux's training does; the
pipelines' sampling schedule uses BFL's empirical mu of the token and step counts, which has no training
analogue), unless `train.timestep.shift` is set. A guidance-distilled transformer (FLUX.2-dev) is trained at
its pipeline's default embedded guidance (`guidance.py`).

Edit pairs (`batch["images"]` [B, N, 3, H, W] in [-1, 1], spindle.data.edit_pairs; resized as the target): each
source encoded as the pipelines encode a reference image (precomputable), its tokens appended after the noisy
latents' with the pipeline's reference ids (time offsets 10, 20, ...); the loss reads the target's tokens only
(the reference-tokens part), as the pipelines keep `noise_pred[:, :S]`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.models.flux2.guidance import EMBEDDED_GUIDANCE, KLEIN_GUIDANCE, Guidance
from spindle.models.flux2.processor import load_tokenizer
from spindle.models.shared.condition import PackedImageConditionModel
from spindle.models.shared.reference_tokens import REFERENCE_TOKENS


class Flux2ConditionModel(PackedImageConditionModel):
    pipeline_class = "diffusers:Flux2Pipeline"
    label = "FLUX.2"
    guidance: Guidance = EMBEDDED_GUIDANCE
    reference_tokens = REFERENCE_TOKENS  # edit pairs' sources after the target's tokens; the loss on the target's

    def text_length_limit(self, pipe: Any) -> int | None:
        return int(pipe.tokenizer_max_length)

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        super().__init__(pipe, device, dtype, max_text_length)
        self.embedded_guidance: float | None = None

    @classmethod
    def vae_downsampling(cls, vae: Any) -> int:
        return int(2 ** (len(vae.config.block_out_channels) - 1))  # the pipelines' vae_scale_factor

    @classmethod
    def pipeline_overrides(cls, root: str | Path) -> dict[str, Any]:
        # FLUX.2-dev's tokenizer component is a PixtralProcessor, which cannot be built here: read_checkpoint
        # loads the folder's tokenizer (processor.py), Klein's as well (the same reader for both)
        return {"tokenizer": None}

    def read_checkpoint(self, root: Path) -> None:
        if self.pipe.tokenizer is None and self.pipe.text_encoder is not None:
            self.pipe.register_modules(tokenizer=load_tokenizer(root / "tokenizer"))
        tcfg = json.loads((root / "transformer" / "config.json").read_text())  # the transformer is not loaded here
        self.embedded_guidance = self.guidance.train_guidance(bool(tcfg.get("guidance_embeds", False)))

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=prompts, device=self.device, max_sequence_length=self.max_text_length
        )
        return {"prompt_embeds": embeds}

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels -> the pipeline's image latents: posterior mode, 2x2-patchified, batch-norm normalized."""
        latents: torch.Tensor = self.pipe._encode_vae_image(pixels.to(self.device, self.dtype), generator=None)
        return latents

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        conditions = super().encode(batch)
        if "images" in batch:  # edit pairs: each source as the pipelines encode a reference image
            images = batch["images"]
            if images.ndim != 5:
                raise ValueError(
                    f"{self.label} source images must be [B, N, 3, H, W]; got {tuple(images.shape)} (spindle.data.edit_pairs)"
                )
            sources = [self.encode_pixels(images[:, i]) for i in range(images.shape[1])]
            conditions["image_latents"] = torch.stack(sources, dim=1)  # [B, N, 4c, h, w]
        return conditions

    def image_tokens(self, x0: torch.Tensor) -> int:
        return x0.shape[-2] * x0.shape[-1]  # patchified latents: a token per latent pixel

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        packed: torch.Tensor = self.pipe._pack_latents(latents)
        return packed

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        noisy, target, sigmas = self.noisy_pair(x0, generators)
        embeds = conditions["prompt_embeds"].to(x0.device)
        b = x0.shape[0]
        scale = self.embedded_guidance
        hidden, ids = self.pack(noisy), self.pipe._prepare_latent_ids(x0).to(x0.device)
        sources = conditions.get("image_latents")
        if sources is not None:  # the pipeline's reference tokens and ids (one time offset per source)
            sources = sources.to(x0)
            references = [sources[:, i] for i in range(sources.shape[1])]
            hidden = REFERENCE_TOKENS.append(hidden, [self.pack(r) for r in references])
            reference_ids = self.pipe._prepare_image_ids([r[:1] for r in references]).to(x0.device)
            ids = torch.cat([ids, reference_ids.expand(b, -1, -1)], dim=1)
        return {
            "hidden_states": hidden,
            "timestep": sigmas.to(x0.device, x0.dtype),  # Flux2Transformer2DModel scales by 1000 itself
            "guidance": None if scale is None else torch.full((b,), scale, device=x0.device),
            "encoder_hidden_states": embeds,
            "txt_ids": self.pipe._prepare_text_ids(embeds).to(x0.device),
            "img_ids": ids,
            "target": self.pack(target),
            "sigmas": sigmas,
        }


class Flux2KleinConditionModel(Flux2ConditionModel):
    pipeline_class = "diffusers:Flux2KleinPipeline"
    label = "FLUX.2 [klein]"
    guidance = KLEIN_GUIDANCE


CONDITION_MODEL = Flux2ConditionModel  # the family's condition model (DiTFamily finds it by this name)
