"""LTX-2 text-to-video inference with its audio track: the BeforeDenoisingStage, the shared stages' callbacks.

Mirrors diffusers' `LTX2Pipeline.__call__`. Prompts go through the pipeline's Gemma 3 encoder (every hidden state
stacked, left-padded to `max_sequence_length`) and its text connectors (one embedding for the video stream, one for
the audio stream). The video latents are the pipeline's packed tokens [B, Sv, Cv], the audio latents its packed
mel-latent frames [B, Sa, Ca], as many as the video's duration at the audio VAE's rate; the engine denoises both
as one tensor [B, Sv * Cv + Sa * Ca] (the flow-matching Euler step is elementwise, and the pipeline's audio
scheduler is a copy of the video's: one scheduler steps both alike). Sigmas are linear 1 -> 1/steps with the
scheduler's resolution shift (mu from the video token count).

Guidance is the pipeline's, per modality in x0 space (`x0 = x - sigma * v`): the conditional prediction plus
(scale - 1) x its difference to the unconditional one (CFG), plus stg_scale x its difference to a forward with
the self-attention of block 28 skipped (STG), plus (modality_scale - 1) x its difference to a forward with the
audio<->video cross attention off (modality isolation), rescaled toward the conditional prediction's spread
(`guidance_rescale`), back to a velocity for the scheduler. The decode: the video VAE (denormalised latents), and
the audio VAE's mel spectrogram through the vocoder into the waveform the engine returns with the frames.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from spindle.contracts.request import (
    Req,
    RequestError,
    SamplingParams,
    check_frame_count,
    check_int_range,
    check_size,
    resolved,
)
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec
from spindle.models.ltx2 import FRAME_RATE, MAX_SEQUENCE_LENGTH, OPTIONS
from spindle.models.ltx2.parallel import sequence_parallel_plan

STG_BLOCKS = [28]  # LTX2Pipeline's default `spatio_temporal_guidance_blocks` (LTX-2.3's)
PIPELINE_MODULE = "diffusers.pipelines.ltx2.pipeline_ltx2"


def scales(p: SamplingParams) -> dict[str, dict[str, float]]:
    """{"video": ..., "audio": ...}: each modality's guidance scales, an unset audio one falling back to the
    video's as the pipeline's `audio_x = audio_x or x` does."""
    x = p.extra
    video = {
        "cfg": float(resolved(p.guidance_scale, "guidance_scale")),
        "stg": float(x["stg_scale"]),
        "modality": float(x["modality_scale"]),
        "rescale": float(x["guidance_rescale"]),
    }
    names = {"cfg": "audio_guidance_scale", "stg": "audio_stg_scale", "modality": "audio_modality_scale"}
    audio = {k: float(x[name]) or video[k] for k, name in names.items()}
    audio["rescale"] = float(x["audio_guidance_rescale"]) or video["rescale"]
    return {"video": video, "audio": audio}


def split(joint: torch.Tensor, req: Req) -> tuple[torch.Tensor, torch.Tensor]:
    """The joint latents [B, Nv + Na] (or a prediction of them) -> (video [B, Sv, Cv], audio [B, Sa, Ca])."""
    (sv, cv), (sa, ca) = req.extra["video_tokens"], req.extra["audio_tokens"]
    video, audio = joint.split([sv * cv, sa * ca], dim=1)
    return video.reshape(-1, sv, cv), audio.reshape(-1, sa, ca)


def audio_latent_frames(pipe: Any, num_frames: int) -> int:
    """The audio latent frames of a video of `num_frames` at the frame rate: its duration at the audio VAE's rate
    (sample rate / mel hop / its temporal compression: 25 a second), as LTX2Pipeline counts them."""
    per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
    return round(num_frames / float(FRAME_RATE) * per_second)


def check_audio_split(tokens: int, frames: int, degree: int) -> None:
    """RequestError unless the `tokens` audio tokens of a `frames`-frame video split over `degree` SP ranks."""
    if tokens % degree:
        raise RequestError(
            f"sequence parallelism over {degree} ranks splits the audio track's tokens too: num_frames={frames} gives "
            f"{tokens} audio latent frames at {FRAME_RATE} fps, not divisible by {degree}; choose num_frames so that "
            f"the audio token count (round(num_frames / {FRAME_RATE} x 25) on LTX-2) is a multiple of {degree}",
            field="num_frames",
        )


def joined(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


class LTX2BeforeDenoisingStage(BeforeDenoisingStage):
    pipeline_class = "LTX2Pipeline"

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        module = importlib.import_module(PIPELINE_MODULE)
        self.module = module
        # the family's pipeline without its transformer: its prompt encoder and latent helpers are the reference
        cls = getattr(importlib.import_module("diffusers"), self.pipeline_class)
        parts = {k: v for k, v in components.items() if k in spec.components and k != "transformer"}
        self.text_pipe = cls(**parts, transformer=None)
        self.transformer = components[spec.transformer_component]
        self.scheduler = components["scheduler"]
        if components["vae"].config.timestep_conditioning:
            # the pipeline decodes such a VAE at `decode_timestep` with `decode_noise_scale` noise, which the shared
            # decode does not run
            raise ValueError(
                "vae/config.json sets timestep_conditioning=true, which Spindle's LTX-2 engine does not decode; "
                "use an LTX-2 / 2.3 checkpoint (its video VAE has no timestep conditioning)"
            )
        self.scale_temporal = self.text_pipe.vae_temporal_compression_ratio
        self.scale_spatial = self.text_pipe.vae_spatial_compression_ratio

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_size(params, 32, 32, f"LTX2Pipeline takes multiples of 32; VAE x{self.scale_spatial}")
        check_frame_count(params, self.scale_temporal)
        check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=MAX_SEQUENCE_LENGTH)

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        return (
            p.batch_size,
            self.transformer.config.in_channels,
            (resolved(p.num_frames, "num_frames") - 1) // self.scale_temporal + 1,
            resolved(p.height, "height") // self.scale_spatial,
            resolved(p.width, "width") // self.scale_spatial,
        )

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(video text embeddings, audio text embeddings, their mask) of `prompts`, each repeated per video: Gemma's
        stacked hidden states through the connectors."""
        pipe = self.text_pipe
        embeds, mask = pipe._get_gemma_prompt_embeds(
            prompt=prompts,
            num_videos_per_prompt=p.num_outputs_per_prompt,
            max_sequence_length=resolved(p.max_sequence_length, "max_sequence_length"),
            device=device,
        )
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=side)
        dtype = self.transformer.dtype
        return video.to(dtype), audio.to(dtype), mask

    def forward(self, req: Req) -> Req:
        p = req.params
        device, pipe = req.device, self.text_pipe
        guidance = scales(p)
        req.extra["scales"] = guidance
        req.do_cfg = guidance["video"]["cfg"] > 1.0 or guidance["audio"]["cfg"] > 1.0  # the pipeline's rule
        req.cfg_scale = guidance["video"]["cfg"]
        req.model_dtype = self.transformer.dtype
        req.prompt_embeds, req.extra["audio_embeds"], req.extra["mask"] = self.encode(p.prompts, p, device)
        if req.do_cfg:
            negative = p.negative_prompt if p.negative_prompt is not None else ""
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            embeds = self.encode(negative, p, device)
            req.negative_prompt_embeds, req.extra["negative_audio_embeds"], req.extra["negative_mask"] = embeds
        height, width, frames = resolved(p.height, "height"), resolved(p.width, "width"), p.num_frames
        batch = p.batch_size
        video = self.video_latents(req, height, width, resolved(frames, "num_frames"))
        fps = float(FRAME_RATE)
        audio_frames = audio_latent_frames(pipe, resolved(frames, "num_frames"))
        mel_bins = pipe.audio_vae.config.mel_bins
        audio = pipe.prepare_audio_latents(
            batch,
            num_channels_latents=pipe.audio_vae.config.latent_channels,
            audio_latent_length=audio_frames,
            num_mel_bins=mel_bins,
            noise_scale=0.0,
            dtype=torch.float32,
            device=device,
            generator=req.generator,
        )
        req.latents = joined(video, audio)
        req.extra.update(
            video_tokens=tuple(video.shape[1:]),
            audio_tokens=tuple(audio.shape[1:]),
            audio_frames=audio_frames,
            mel_bins=mel_bins // pipe.audio_vae_mel_compression_ratio,
        )
        shape = self.latent_shape(p)
        req.raw_latent_shape = shape
        _, _, f, h, w = shape
        # the positions of both streams, the same at every step (the pipeline computes them once too)
        model = self.transformer
        req.extra["video_coords"] = model.rope.prepare_video_coords(batch, f, h, w, device, fps=fps)
        req.extra["audio_coords"] = model.audio_rope.prepare_audio_coords(batch, audio_frames, device)
        req.timesteps, req.scheduler = self.timesteps(p, video.shape[1], device)
        return req

    def video_latents(self, req: Req, height: int, width: int, frames: int) -> torch.Tensor:
        """The packed video noise [B, Sv, C] (image-to-video: with the first frame's latents)."""
        channels = self.transformer.config.in_channels
        return self.text_pipe.prepare_latents(
            req.params.batch_size, channels, height, width, frames, 0.0, torch.float32, req.device, req.generator
        )

    def timesteps(self, p: SamplingParams, tokens: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """The pipeline's schedule: sigmas linear 1 -> 1/steps, shifted by mu of the video token count."""
        steps = resolved(p.num_inference_steps, "num_inference_steps")
        config = self.scheduler.config
        mu = self.module.calculate_shift(
            tokens,
            config.get("base_image_seq_len", 1024),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95),
            config.get("max_shift", 2.05),
        )
        scheduler = copy.deepcopy(self.scheduler)  # schedulers are stateful: one copy per request
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = self.module.retrieve_timesteps(scheduler, steps, device, None, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return timesteps, scheduler


class LTX2Inference(InferenceSpec):
    options = OPTIONS
    family = "ltx2"
    media = "video"
    output_layout = None  # the joint latents are flat tokens, not a spatial layout
    components: tuple[str, ...] = (
        "tokenizer",
        "text_encoder",
        "connectors",
        "vae",
        "audio_vae",
        "vocoder",
        "scheduler",
        "transformer",
    )
    before_denoising_cls: Any = LTX2BeforeDenoisingStage

    def check_checkpoint(self, model_index: dict[str, Any]) -> None:
        for name in ("duration_head", "prompt_enhancer"):
            entry = model_index.get(name)
            if isinstance(entry, list) and entry[0] is not None:
                raise ValueError(
                    f"model_index.json has a {name} (an LTX-2.5 checkpoint); Spindle serves LTX-2 / 2.3 checkpoints "
                    "without it: give num_frames, and prompts as they are"
                )

    def cache_unavailable(self, name: str) -> str | None:
        # the step caches are diffusers' hooks; they read a block's outputs through its registry, which has no entry
        # for LTX2VideoTransformerBlock (it returns the video and the audio stream), and the guidance's perturbed
        # forwards (STG, modality isolation) would share one cache state with the conditional one
        return (
            f"cache {name!r} is a diffusers cache hook, which does not run {self.family}'s audio-video blocks "
            "(diffusers registers no outputs for LTX2VideoTransformerBlock); run without a cache"
        )

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # LTX2Pipeline.__call__ defaults: 768x512, 121 frames (5 s at 24 fps), 30 steps, CFG 3 (audio 7), STG 1 at
        # block 28, modality guidance 3, rescale 0.7, 1024 text tokens
        return SamplingParams(
            negative_prompt=None,
            height=512,
            width=768,
            num_frames=121,
            num_inference_steps=30,
            guidance_scale=3.0,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            extra=OPTIONS.defaults(),
        )

    def guidance_branches(self, req: Req) -> tuple[str, ...]:
        video, audio = req.extra["scales"]["video"], req.extra["scales"]["audio"]
        stg = ("stg",) if video["stg"] > 0 or audio["stg"] > 0 else ()
        return stg + (("modality",) if video["modality"] > 1 or audio["modality"] > 1 else ())

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        uncond = branch == "uncond"
        x = req.extra
        video, audio = split(latents.to(req.model_dtype), req)
        timestep = t.expand(latents.shape[0])
        _, _, f, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        return {
            "hidden_states": video,
            "audio_hidden_states": audio,
            "encoder_hidden_states": req.negative_prompt_embeds if uncond else req.prompt_embeds,
            "audio_encoder_hidden_states": x["negative_audio_embeds" if uncond else "audio_embeds"],
            "timestep": timestep,
            "sigma": timestep,  # (LTX-2.3's)
            "encoder_attention_mask": x["negative_mask" if uncond else "mask"],
            "audio_encoder_attention_mask": x["negative_mask" if uncond else "mask"],
            "num_frames": f,
            "height": h,
            "width": w,
            "fps": float(FRAME_RATE),
            "audio_num_frames": x["audio_frames"],
            "video_coords": x["video_coords"],
            "audio_coords": x["audio_coords"],
            "isolate_modalities": branch == "modality",
            "spatio_temporal_guidance_blocks": STG_BLOCKS if branch == "stg" else None,
            "perturbation_mask": None,
            "use_cross_timestep": True,
            "attention_kwargs": None,
            "return_dict": False,
        }

    def model_output(self, out: Any) -> torch.Tensor:
        video, audio = out[0], out[1]
        return joined(video.float(), audio.float())

    def guide(
        self, req: Req, latents: torch.Tensor, i: int, preds: dict[str, torch.Tensor], cfg_scale: float
    ) -> torch.Tensor:
        """LTX2Pipeline's guidance, per modality in x0 space (the module docstring)."""
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        sigma = req.scheduler.sigmas[i]
        samples = split(latents, req)
        parts = {name: split(pred, req) for name, pred in preds.items()}
        out = []
        for m, s in enumerate(req.extra["scales"].values()):  # video, then audio
            x = samples[m]
            x0 = {name: x - pred[m] * sigma for name, pred in parts.items()}
            cond = x0["cond"]
            guided = cond + ((s["cfg"] - 1) * (cond - x0["uncond"]) if "uncond" in x0 else 0)
            guided = guided + (s["stg"] * (cond - x0["stg"]) if "stg" in x0 else 0)
            guided = guided + ((s["modality"] - 1) * (cond - x0["modality"]) if "modality" in x0 else 0)
            if s["rescale"] > 0:
                guided = rescale_noise_cfg(guided, cond, guidance_rescale=s["rescale"])
            out.append((x - guided) / sigma)
        return joined(*out)

    def post_denoising(self, latents: torch.Tensor, req: Req) -> torch.Tensor:
        """The joint latents -> the video VAE's [B, C, F, h, w]; the audio part is kept for `decode_audio`."""
        from diffusers import LTX2Pipeline

        video, req.extra["audio_latents"] = split(latents, req)
        _, _, f, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        return LTX2Pipeline._unpack_latents(video, f, h, w)

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[Any, Any]:
        # LTX2Pipeline._denormalize_latents: latents * std / scaling_factor + mean, per channel
        view = (1, -1, 1, 1, 1)
        std, mean = vae.latents_std.view(view).to(latents), vae.latents_mean.view(view).to(latents)
        return vae.config.scaling_factor / std, mean

    def decode_audio(self, req: Req, components: dict[str, Any]) -> tuple[np.ndarray, int]:
        """The audio latents -> the audio VAE's mel spectrogram -> the vocoder's waveform [B, channels, samples]."""
        from diffusers import LTX2Pipeline

        audio_vae, vocoder = components["audio_vae"], components["vocoder"]
        latents = LTX2Pipeline._denormalize_audio_latents(
            req.extra["audio_latents"], audio_vae.latents_mean, audio_vae.latents_std
        )
        latents = LTX2Pipeline._unpack_audio_latents(latents, req.extra["audio_frames"], req.extra["mel_bins"])
        mel = audio_vae.decode(latents.to(audio_vae.dtype), return_dict=False)[0]
        waveform = vocoder(mel).float().cpu().numpy()
        return waveform, int(vocoder.config.output_sampling_rate)

    def sequence_parallel_plan(self, transformer_config: Mapping[str, Any]) -> dict[str, Any]:
        return sequence_parallel_plan(transformer_config)  # both streams split (spindle.models.ltx2.parallel)

    def check_sequence_parallel(self, req: Req, transformer: torch.nn.Module, degree: int) -> None:
        """The plan splits the audio tokens and the text too: each count must divide `degree`. The audio count is
        the video's duration at the rate the transformer's audio positions assume (its config's sample rate, mel
        hop and audio scale factor: the audio VAE's on LTX-2's checkpoints)."""
        p = req.params
        config: Any = transformer.config  # a diffusers model: its config
        rate = SimpleNamespace(
            audio_sampling_rate=config.audio_sampling_rate,
            audio_hop_length=config.audio_hop_length,
            audio_vae_temporal_compression_ratio=config.audio_scale_factor,
        )
        frames = resolved(p.num_frames, "num_frames")
        check_audio_split(audio_latent_frames(rate, frames) // config.audio_patch_size_t, frames, degree)
        text = resolved(p.max_sequence_length, "max_sequence_length")
        if text % degree:
            raise RequestError(
                f"sequence parallelism over {degree} ranks splits the text tokens too, and max_sequence_length={text} "
                f"is not divisible by {degree}; use a multiple of {degree}",
                field="max_sequence_length",
            )

    def prepare_sequence_parallel(self, req: Req, degree: int) -> None:
        """The audio tokens as the pipeline counted them (the audio VAE's rate) divide `degree` too."""
        check_audio_split(req.extra["audio_tokens"][0], resolved(req.params.num_frames, "num_frames"), degree)

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        """The video tokens (what training counts and the SP plan would split; the audio stream's are fewer)."""
        _, _, f, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        config: Any = transformer.config  # a diffusers model: its config
        return (f // config.patch_size_t) * (h // config.patch_size) * (w // config.patch_size)


INFERENCE = LTX2Inference()
