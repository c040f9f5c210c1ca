"""`write_video` with a soundtrack: the mp4 gets an AAC stream of the waveform's channels, rate and length (a
model that makes audio, LTX-2, writes it so: tests/train/test_ltx2.py); without one it stays silent; a bad waveform
is named before anything is written."""

from __future__ import annotations

import av
import numpy as np
import pytest

from spindle.data.media import write_video


@pytest.mark.parametrize("channels", [1, 2])
def test_the_audio_track_has_the_waveforms_channels_rate_and_length(channels, tmp_path):
    rate, samples = 16000, 5280
    wave = 0.5 * np.sin(np.linspace(0, 300, samples))[None].repeat(channels, 0)
    path = write_video(tmp_path / "clip.mp4", np.zeros((9, 16, 16, 3), np.uint8), fps=24, audio=wave, sample_rate=rate)
    with av.open(str(path)) as container:
        (video,), (sound,) = container.streams.video, container.streams.audio
        assert video.frames == 9 and (sound.rate, sound.channels) == (rate, channels)
        assert float(sound.duration * sound.time_base) == pytest.approx(samples / rate, abs=1e-3)
        decoded = np.concatenate([f.to_ndarray() for f in container.decode(sound)], axis=1)
    assert np.abs(decoded).max() > 0.1  # the tone, not silence


def test_a_silent_video_has_no_audio_stream(tmp_path):
    from spindle.data.media import write_video

    path = write_video(tmp_path / "silent.mp4", np.zeros((3, 16, 16, 3), np.uint8), fps=8)
    with av.open(str(path)) as container:
        assert len(container.streams.video) == 1 and not container.streams.audio


def test_bad_audio_is_named(tmp_path):
    from spindle.data.media import write_video

    frames = np.zeros((3, 16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match=r"audio must have shape \[1 or 2 channels, samples > 0\]; got \(3, 10\)"):
        write_video(tmp_path / "a.mp4", frames, audio=np.zeros((3, 10)), sample_rate=16000)
    with pytest.raises(ValueError, match="audio needs a positive sample_rate; got None"):
        write_video(tmp_path / "a.mp4", frames, audio=np.zeros((2, 10)))
