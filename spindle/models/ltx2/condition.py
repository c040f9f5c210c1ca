"""LTX-2's frozen condition components: Gemma 3 + the text connectors, the video VAE, the audio VAE (with
`data.audio`), the scheduler; and the training inputs of its audio-video transformer.

With `data.audio`, each clip's soundtrack trains the audio stream with the video: its clean latents are the audio
VAE's encoding of the clip's log-mel spectrogram (`spindle.models.ltx2.audio`), noised at the sample's sigma (the
video's: one noise level for both streams, as LTX-2's own trainer draws it) with noise drawn after the video's from
the sample's RNG; the audio timestep (and `audio_sigma`) is the video's, the target the audio velocity
`noise - x0`, returned as `extra_targets[1]` (the transformer's second output) so the loss adds the audio stream's
mean squared error to the video's, each a mean over its own elements (equal weights, as LTX-2's trainer sums
`video_loss + audio_loss`; a mean over both streams' elements would give the audio, some 2% of them, almost no say).

Without it training is video-only: a clip's video is trained, its audio branch is not (the loss is the video
stream's). The rule for the audio stream, which the transformer always runs: it gets pure Gaussian noise at sigma
1 (timestep 1000), i.e. what the audio stream holds at the first step of every generation, so the video learns
under the audio condition it meets at the start of sampling and no audio model runs. Video-only is the default
because most video datasets have no usable soundtrack, and LoRAs of LTX-2 (the common fine-tune) target the look
and motion of the video.

The video follows the pipeline's conventions: latents `(z - mean) * scaling_factor / std` of the VAE's mode (its
`_normalize_latents`, what the decode undoes), packed to the pipeline's tokens [B, F * h * w, C]; noise and the
flow-matching pair on those tokens, timestep `sigma * 1000` (also the transformer's `sigma`), the velocity
`noise - x0` as the target, as the pipeline's Euler step reads the prediction. Prompts go through the pipeline's
encoder and connectors (`max_text_length` tokens, left-padded, with the mask).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.condition import AudioTrack, PixelGrid
from spindle.models.ltx2 import FRAME_RATE, MAX_SEQUENCE_LENGTH
from spindle.models.ltx2 import audio as soundtrack
from spindle.models.ltx2.inference import audio_latent_frames
from spindle.models.shared.condition import PipelineConditionModel, meta_vae
from spindle.ops.flow_matching import flow_matching_pair, sample_sigmas


class LTX2ConditionModel(PipelineConditionModel):
    pipeline_class = "diffusers:LTX2Pipeline"
    label = "LTX-2"
    max_text_limit = MAX_SEQUENCE_LENGTH

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        super().__init__(pipe, device, dtype, max_text_length)
        self.audio_channels = 0  # the transformer's audio input width (read_checkpoint)

    def read_checkpoint(self, root: Path) -> None:
        super().read_checkpoint(root)
        config = json.loads((root / "transformer" / "config.json").read_text())
        self.audio_channels = config["audio_in_channels"]

    @classmethod
    def pixel_grid(cls, root: str | Path) -> PixelGrid:
        vae = meta_vae(root)
        multiple = max(32, vae.spatial_compression_ratio)  # LTX2Pipeline takes multiples of 32
        return PixelGrid(multiple, multiple, frame_multiple=vae.temporal_compression_ratio)

    @classmethod
    def audio_track(cls, root: str | Path) -> AudioTrack:
        return soundtrack.audio_track(root, FRAME_RATE)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.pipe
        embeds, mask = pipe._get_gemma_prompt_embeds(
            prompt=list(prompts), max_sequence_length=self.max_text_length, device=self.device
        )
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=getattr(pipe.tokenizer, "padding_side", "left"))
        return {"prompt_embeds": video.to(self.dtype), "audio_prompt_embeds": audio.to(self.dtype), "prompt_mask": mask}

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W] in [-1, 1] -> the VAE mode's normalised latents [B, C, f, h, w] (deterministic)."""
        _, _, frames, height, width = pixels.shape
        vae = self.pipe.vae
        multiple, temporal = max(32, vae.spatial_compression_ratio), vae.temporal_compression_ratio
        if (frames - 1) % temporal:
            raise ValueError(f"{self.label} needs num_frames = {temporal}k+1; got {frames}")
        if height % multiple or width % multiple:
            raise ValueError(f"{self.label} needs height and width divisible by {multiple}; got {height}x{width}")
        return self.pipe._normalize_latents(
            self.vae_latents(pixels), vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        )

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        conditions = {"latents": self.encode_pixels(batch["pixels"]), **self.encode_prompts(batch["caption"])}
        if "audio" in batch:  # data.audio: the clips' soundtracks [B, channels, samples]
            frames = audio_latent_frames(self.pipe, batch["pixels"].shape[2])
            conditions["audio_latents"] = soundtrack.audio_latents(self.pipe, batch["audio"], frames).to(self.dtype)
        return conditions

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        from diffusers.utils.torch_utils import randn_tensor

        latents = conditions["latents"]
        b, _, f, h, w = latents.shape
        x0 = self.pipe._pack_latents(latents)
        sigmas = sample_sigmas(self.timestep_sampling, generators, within=self.sigma_range)
        noisy, target = flow_matching_pair(x0, sigmas, generators)
        device = x0.device
        timestep = (sigmas * self.num_train_timesteps).to(device, x0.dtype)
        extra: dict[int, torch.Tensor] = {}
        if "audio_latents" in conditions:  # data.audio (module docstring): the video's sigma, noise drawn after its
            clean = conditions["audio_latents"].to(device, torch.float32)
            audio, extra[1] = flow_matching_pair(clean, sigmas, generators)
            audio_frames, audio_timestep = clean.shape[1], timestep
        else:  # the video-only rule (module docstring): pure noise at sigma 1, drawn after the video's
            frames = (f - 1) * self.pipe.vae_temporal_compression_ratio + 1
            audio_frames = audio_latent_frames(self.pipe, frames)
            audio = randn_tensor((b, audio_frames, self.audio_channels), generator=generators, dtype=torch.float32)
            audio_timestep = torch.full_like(timestep, float(self.num_train_timesteps))
        mask = conditions["prompt_mask"].to(device)
        return {
            "hidden_states": noisy,
            "audio_hidden_states": audio.to(device, x0.dtype),
            "encoder_hidden_states": conditions["prompt_embeds"].to(device),
            "audio_encoder_hidden_states": conditions["audio_prompt_embeds"].to(device),
            "timestep": timestep,
            "sigma": timestep,
            "audio_timestep": audio_timestep,
            "audio_sigma": audio_timestep,
            "encoder_attention_mask": mask,
            "audio_encoder_attention_mask": mask,
            "num_frames": f,
            "height": h,
            "width": w,
            "fps": float(FRAME_RATE),
            "audio_num_frames": audio_frames,
            "use_cross_timestep": True,
            "target": target,
            "sigmas": sigmas,
            **({"extra_targets": extra} if extra else {}),
        }

    def tokens_per_sample(self, inputs: dict[str, Any]) -> int:
        return int(inputs["hidden_states"].shape[1])


CONDITION_MODEL = LTX2ConditionModel  # the family's condition model (DiTFamily finds it by this name)
