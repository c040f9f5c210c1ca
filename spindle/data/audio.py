"""Audio clips -> the audio encoder's log-mel features, as the stock Qwen-Omni processor builds them; and a
training video's soundtrack (`read_audio_track`, `data.audio` of a DiT family with an audio stream: LTX-2).

Files (wav, flac, mp3, m4a/aac, ogg: whatever PyAV decodes; the audio track of a video file too) are
decoded with PyAV, mixed down to mono float32 and resampled to the feature extractor's `sampling_rate`
(16 kHz for Qwen-Omni) by PyAV's resampler. The waveform then goes through the model's own
`WhisperFeatureExtractor` exactly as `Qwen2_5OmniProcessor` calls it (`padding="max_length"`, attention
mask on): padded with silence to the extractor's window (`chunk_length` seconds), log-mel over the whole
window, and the frames the mask marks valid kept. Keeping only those frames changes nothing the model
computes (it drops the padded frames itself) and keeps batches small.

The maximum clip length is that window: `chunk_length` seconds of the checkpoint's
`preprocessor_config.json` (300 s for the published Qwen2.5-Omni, 10 s for the tiny one). The stock
processor silently cuts longer clips; here a longer clip, like an empty or undecodable one, is a
`file:line` error (or a counted skip with `data.skip_bad_samples`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from spindle.contracts.condition import AudioTrack
from spindle.data.media import MediaError, is_video_path, probe_video


def decode_audio(path: Path, sampling_rate: int) -> np.ndarray:
    """The first audio stream of `path` as mono float32 samples at `sampling_rate`."""
    import av

    if not path.is_file():
        raise ValueError(f"audio {path} not found")
    chunks: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError(f"audio {path} has no audio stream")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
            for frame in container.decode(container.streams.audio[0]):
                chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # the resampler's tail
    except (av.FFmpegError, OSError) as e:
        raise ValueError(f"audio {path} cannot be decoded ({e})") from None
    samples = np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise ValueError(f"audio {path} has no samples")
    return samples


def read_audio_track(path: Path, track: AudioTrack, frames: int) -> torch.Tensor:
    """The soundtrack of a training clip of `frames` frames: its first audio stream resampled by PyAV to the
    track's rate and channels (a mono track is upmixed), the first `track.samples(frames)` samples as float32
    [channels, samples]. A MediaError (file: reason) for an image, a video without an audio stream, an undecodable one,
    and a clip whose video or sound does not last `frames / frame_rate` seconds (within one frame): the frames
    are sampled over the whole clip, so only then are the sound and the frames the model sees in sync. A track
    short of the length by less than a frame (an encoder's priming) is padded with silence."""
    import av

    seconds, tolerance = frames / track.frame_rate, 1 / track.frame_rate
    if not is_video_path(path):
        raise MediaError(
            path,
            "an image has no sound, and data.audio trains videos with their audio track",
            "Train images in a run without data.audio, or remove them.",
        )
    total, fps, _, _ = probe_video(path)
    if fps <= 0 or abs(total / fps - seconds) > tolerance:
        lasts = f"{total / fps:.3f} s ({total} frames at {fps:g} fps)" if fps > 0 else "an unknown time (no frame rate)"
        raise MediaError(
            path,
            f"the video lasts {lasts}, but data.audio trains clips of data.num_frames / {track.frame_rate:g} fps = "
            f"{seconds:.3f} s, so that the sound stays in sync with the frames sampled from the clip",
            f"Cut the clip to {seconds:.3f} s, or set data.skip_bad_samples=true to skip it.",
        )
    layout = {1: "mono", 2: "stereo"}[track.channels]
    chunks: list[np.ndarray] = []
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise MediaError(
                    path,
                    "no audio track, and data.audio trains every clip's sound",
                    "Give the clip its soundtrack, remove it, train without data.audio, or set "
                    "data.skip_bad_samples=true to skip it.",
                )
            resampler = av.AudioResampler(format="fltp", layout=layout, rate=track.sample_rate)
            for frame in container.decode(container.streams.audio[0]):
                chunks += [f.to_ndarray() for f in resampler.resample(frame)]
            chunks += [f.to_ndarray() for f in resampler.resample(None)]  # the resampler's tail
    except (av.FFmpegError, OSError) as e:
        raise MediaError(path, f"the audio track cannot be decoded ({e.__class__.__name__}: {e})") from None
    wave = np.concatenate(chunks, axis=1) if chunks else np.zeros((track.channels, 0), np.float32)
    want = track.samples(frames)
    if wave.shape[1] < want - track.sample_rate * tolerance:
        raise MediaError(
            path,
            f"the audio track lasts {wave.shape[1] / track.sample_rate:.3f} s, shorter than the clip's {seconds:.3f} s",
        )
    wave = np.pad(wave[:, :want], ((0, 0), (0, max(0, want - wave.shape[1]))))
    return torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))


def audio_features(samples: np.ndarray, feature_extractor: Any, where: str = "audio") -> torch.Tensor:
    """A waveform at the extractor's rate -> its valid log-mel frames [mel bins, frames] (the stock
    processor's `input_features` where its `feature_attention_mask` is 1)."""
    rate = int(feature_extractor.sampling_rate)
    limit = int(feature_extractor.n_samples)
    if samples.size > limit:
        raise ValueError(
            f"{where} is {samples.size / rate:.2f} s long, more than the feature extractor's {limit / rate:g} s "
            "window (chunk_length in preprocessor_config.json); cut the clip into shorter ones"
        )
    out = feature_extractor(
        [samples], sampling_rate=rate, return_attention_mask=True, padding="max_length", return_tensors="pt"
    )
    mask = out["attention_mask"][0].bool()
    features: torch.Tensor = out["input_features"][0][:, mask]
    return features


def audio_token_count(frames: int) -> int:
    """How many decoder tokens the audio encoder makes of `frames` mel frames (its stride-2 convolution, then
    its stride-2 pooling: `_get_feat_extract_output_lengths`)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


# container suffix -> (PyAV codec, sample format) of `write_audio`
_ENCODERS = {".wav": ("pcm_s16le", "s16"), ".flac": ("flac", "s16"), ".m4a": ("aac", "fltp"), ".mp3": ("mp3", "fltp")}


def write_audio(path: Path, samples: np.ndarray, sampling_rate: int) -> Path:
    """Mono float samples in [-1, 1] -> an audio file whose codec follows the suffix (wav, flac, m4a, mp3)."""
    import av

    codec, fmt = _ENCODERS[path.suffix]
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream: Any = container.add_stream(codec, rate=sampling_rate, layout="mono")
        data = samples.astype(np.float32)[None]
        if fmt == "s16":
            data = (np.clip(data, -1, 1) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(data, format=fmt, layout="mono")
        frame.sample_rate = sampling_rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return path


def add_audio_track(video: Path, samples: np.ndarray, sampling_rate: int, out: Path) -> Path:
    """`video`'s stream copied into `out` (mp4/mkv) with `samples` (mono, [-1, 1]) as an AAC audio track."""
    import av

    with av.open(str(video)) as source, av.open(str(out), mode="w") as container:
        frames_in = source.streams.video[0]
        frames_out: Any = container.add_stream_from_template(frames_in)
        sound: Any = container.add_stream("aac", rate=sampling_rate, layout="mono")
        for packet in source.demux(frames_in):
            if packet.dts is not None:
                packet.stream = frames_out
                container.mux(packet)
        frame = av.AudioFrame.from_ndarray(samples.astype(np.float32)[None], format="fltp", layout="mono")
        frame.sample_rate = sampling_rate
        for packet in [*sound.encode(frame), *sound.encode(None)]:
            container.mux(packet)
    return out
