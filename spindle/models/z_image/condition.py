"""Z-Image's frozen condition components: the Qwen3 text encoder + chat-template tokenizer, the
FLUX.1-style VAE, the scheduler; and the training inputs of its list-taking transformer.

Training follows the pipeline's conventions: latents `(z - shift_factor) * scaling_factor` of the
VAE's mode (what the pipeline's decode undoes), noise and the flow-matching pair in the VAE layout;
the transformer takes one latent [C, 1, h, w] and one caption per sample with timestep `1 - sigma`
(the pipeline's `(1000 - t) / 1000`), and predicts `x0 - noise`: its negated output is compared with
the velocity target `noise - x0`. Prompts go through the pipeline's own `encode_prompt` (one
variable-length tensor each); they are zero-padded to `max_text_length` with their lengths kept, so
precomputed conditions batch together, and cut back to their lengths for the forward. Sigmas get
the scheduler's resolution-dependent shift where it has one (as Flux) unless the training config
sets a static shift.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.condition import PixelGrid
from spindle.models.shared.condition import PipelineConditionModel, frames_as_images, meta_vae
from spindle.models.shared.latents import resolution_shift
from spindle.models.z_image import MAX_SEQUENCE_LENGTH
from spindle.ops.flow_matching import flow_matching_pair, sample_sigmas


def pad_captions(embeds: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt embeddings [S_i, D] -> (zero-padded [B, length or max S_i, D], lengths [B])."""
    lengths = torch.tensor([e.shape[0] for e in embeds], dtype=torch.long)
    length = int(lengths.max()) if length is None else length
    if int(lengths.max()) > length:
        raise ValueError(f"prompt embeddings have {int(lengths.max())} tokens, more than the {length} to pad to")
    padded = torch.stack([torch.cat([e, e.new_zeros(length - e.shape[0], e.shape[1])]) for e in embeds])
    return padded, lengths


def captions(padded: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """`pad_captions` undone: the list of per-prompt embeddings the transformer takes."""
    return [padded[i, : int(n)] for i, n in enumerate(lengths)]


class ZImageConditionModel(PipelineConditionModel):
    pipeline_class = "diffusers:ZImagePipeline"
    label = "Z-Image"
    max_text_limit = MAX_SEQUENCE_LENGTH

    @classmethod
    def pixel_grid(cls, root: Any) -> PixelGrid:
        vae = meta_vae(root)
        multiple = 2 * 2 ** (len(vae.config.block_out_channels) - 1)  # VAE downsampling x 2x2 patches
        return PixelGrid(multiple, multiple)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),  # the pipeline writes the templated prompts into the list it is given
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_text_length,
        )
        padded, lengths = pad_captions([e.to(self.dtype) for e in embeds], self.max_text_length)
        return {"prompt_embeds": padded, "prompt_lengths": lengths.to(self.device)}

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = frames_as_images(pixels, self.label)
        multiple = 2 * self.pipe.vae_scale_factor
        height, width = pixels.shape[-2:]
        if height % multiple or width % multiple:
            raise ValueError(f"Z-Image needs height and width divisible by {multiple}; got {height}x{width}")
        cfg = self.pipe.vae.config
        return (self.vae_latents(pixels) - cfg.shift_factor) * cfg.scaling_factor

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"latents": self.encode_pixels(batch["pixels"]), **self.encode_prompts(batch["caption"])}

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        x0 = conditions["latents"]
        _, _, h, w = x0.shape
        shift = None
        if self.pipe.scheduler.config.get("use_dynamic_shifting"):
            _, shift = resolution_shift(self.pipe.scheduler, (h // 2) * (w // 2))
        sigmas = sample_sigmas(self.timestep_sampling, generators, shift_fn=shift)
        noisy, target = flow_matching_pair(x0, sigmas, generators)
        return {
            "x": list(noisy.unsqueeze(2).unbind(0)),
            "t": (1.0 - sigmas).to(x0.device, x0.dtype),  # the pipeline's (1000 - t) / 1000
            "cap_feats": captions(conditions["prompt_embeds"].to(x0.device), conditions["prompt_lengths"]),
            "target": target,
            "sigmas": sigmas,
        }

    def tokens_per_sample(self, inputs: dict[str, Any]) -> int:
        _, _, h, w = inputs["x"][0].shape  # [C, 1, h, w], patchified 2x2
        return (h // 2) * (w // 2)

    def target_prediction(self, pred: Any, target: torch.Tensor) -> torch.Tensor:
        """The transformer's per-sample outputs, stacked and negated (it predicts x0 - noise)."""
        return -torch.stack(list(pred), dim=0).squeeze(2)


CONDITION_MODEL = ZImageConditionModel  # the family's condition model (DiTFamily finds it by this name)
