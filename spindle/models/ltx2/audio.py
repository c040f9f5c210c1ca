"""LTX-2's soundtrack for training (`data.audio`): a clip's waveform -> the audio stream's clean latents.

diffusers' LTX2Pipeline only decodes audio (audio VAE -> mel spectrogram -> vocoder); the encoder side is the LTX-2
reference's audio processor, whose settings the audio VAE's config carries but for the FFT size: a log-mel
spectrogram of each channel (`in_channels`: stereo for LTX-2) at the VAE's `sample_rate`, a 1024-point periodic Hann
STFT (`N_FFT`) centred with reflect padding, hop `mel_hop_length`, magnitudes (power 1) through `mel_bins` Slaney mel
filters over 0 .. sample_rate / 2 with Slaney area normalisation, `log(max(mel, 1e-5))` (the floor the vocoder's
input follows), laid out [B, channels, frames, mel bins] as the audio VAE takes it. The VAE's posterior mode is then
packed and normalised as the pipeline's `prepare_audio_latents` does with given latents (`_pack_audio_latents`:
[B, L, C * M], then `_normalize_audio_latents` with the VAE's `latents_mean` / `latents_std`), what its decode
undoes. The causal VAE makes a latent frame more than the clip's duration holds (the centred STFT's last frame); the
first `audio_latent_frames(pipe, frames)` are kept: the count LTX2Pipeline generates for that many frames.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.condition import AudioTrack

N_FFT = 1024  # the LTX-2 reference audio processor's STFT size (and window length); not in the audio VAE's config
LOG_FLOOR = 1e-5


def audio_track(root: str | Path, frame_rate: float) -> AudioTrack:
    """The waveform format the checkpoint's audio VAE encodes (its config), at the pipeline's frame rate."""
    path = Path(root) / "audio_vae" / "config.json"
    if not path.is_file():
        raise ValueError(f"data.audio: {path} is missing; the LTX-2 checkpoint's audio VAE encodes the soundtrack")
    config = json.loads(path.read_text())
    return AudioTrack(int(config["sample_rate"]), int(config["in_channels"]), frame_rate)


def mel_filters(config: Any) -> torch.Tensor:
    """[N_FFT // 2 + 1, mel_bins] float64 Slaney mel filters of the audio VAE's rate (transformers' filter bank)."""
    from transformers.audio_utils import mel_filter_bank

    rate = config.sample_rate
    bank = mel_filter_bank(
        num_frequency_bins=N_FFT // 2 + 1,
        num_mel_filters=config.mel_bins,
        min_frequency=0.0,
        max_frequency=rate / 2,
        sampling_rate=rate,
        norm="slaney",
        mel_scale="slaney",
    )
    return torch.from_numpy(bank)  # float64, as the spectrum it filters


def log_mel(waveform: torch.Tensor, config: Any) -> torch.Tensor:
    """[B, channels, samples] at the audio VAE's rate -> its input [B, channels, frames, mel_bins]."""
    b, c, n = waveform.shape
    # in float64: the log of a quiet band (a mel value near the 1e-5 floor) turns float32's rounding of the
    # STFT into errors of 1e-5 and more; the audio is small, so the precise spectrum costs nothing
    wave = waveform.reshape(b * c, n).double()
    window = torch.hann_window(N_FFT, dtype=torch.float64, device=wave.device)
    spec = torch.stft(
        wave, N_FFT, config.mel_hop_length, N_FFT, window, center=True, pad_mode="reflect", return_complex=True
    )
    mel = mel_filters(config).to(wave.device).T @ spec.abs()  # [B * C, mel_bins, frames]
    log = torch.log(mel.clamp(min=LOG_FLOOR)).float()
    return log.reshape(b, c, config.mel_bins, -1).transpose(2, 3)


@torch.no_grad()
def audio_latents(pipe: Any, waveform: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """[B, channels, samples] -> the audio stream's normalised clean latents [B, latent_frames, C * M]."""
    vae = pipe.audio_vae
    mel = log_mel(waveform.to(vae.device), vae.config).to(vae.dtype)
    latents = vae.encode(mel).latent_dist.mode()  # [B, C, L, M]
    if latents.shape[2] < latent_frames:
        raise ValueError(
            f"the audio VAE made {latents.shape[2]} latent frames of {waveform.shape[-1]} samples; the clip's "
            f"duration takes {latent_frames}"
        )
    packed = pipe._pack_audio_latents(latents[:, :, :latent_frames])
    return pipe._normalize_audio_latents(packed, vae.latents_mean, vae.latents_std)
