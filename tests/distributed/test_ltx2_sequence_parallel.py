"""LTX-2 (text- and image-to-video, with its audio track) under Ulysses sequence parallelism equals one process.

The family's plan (spindle/models/ltx2/parallel.py) splits the audio stream as well as the video and text ones, so
every attention (the audio<->video cross attentions included) sees consistently split queries and keys. 17 frames
at 64x64: 9 latent frames x 8 x 8 = 576 video tokens and round(17 / 24 x 25) = 18 audio tokens, both even.

- generation on 2 processes (the engine, and `spindle generate --nproc 2 --sp 2`) gives one process's frames and
  audio (1e-5), with the default guidance (CFG, STG, modality isolation: every branch of the forward);
- training under parallel.sp: 2 logs one process's losses and grad norms and exports its weights, video-only and
  with the clips' audio (`data.audio`);
- a frame count whose audio tokens do not split is refused before any work, naming the numbers.

The training gradients of one step (video loss): the conformance suite's SP layouts (ltx2's `sequence_parallel`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from spindle.data.media import write_video
from tests.conftest import assert_same_training, generate_on_sp2_ranks, spindle_train, train_overrides

pytestmark = pytest.mark.slow

FRAMES, FPS, RATE = 17, 24, 16000
REQUEST = dict(prompt="a red fox", height=64, width=64, num_frames=FRAMES, num_inference_steps=2, seed=5)


def _generate_rank(rank: int, world: int, root: str, out: str, options: dict, kw: dict) -> None:
    from spindle.api import load_generator

    result = load_generator(root, **options).generate(**kw)
    np.save(f"{out}.frames{rank}.npy", result.frames)
    np.save(f"{out}.audio{rank}.npy", result.audio)


def engine_on_ranks(root: Path, kw: dict, workdir: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    from spindle.testing.multiprocess import spawn

    out = workdir / "gen"
    spawn(_generate_rank, 2, str(root), str(out), {"sp": 2}, kw)
    return [(np.load(f"{out}.frames{r}.npy"), np.load(f"{out}.audio{r}.npy")) for r in range(2)]


@pytest.mark.parametrize("name", ["ltx2", "ltx2_i2v"])
def test_generation_under_ulysses_equals_one_process(name, tiny_checkpoint, tmp_path):
    from spindle.api import load_generator
    from spindle.models.shared.conformance import noise_image

    root = tiny_checkpoint(name)
    kw = dict(REQUEST, **({"image": noise_image(64, 64), "image_crf": 0} if name == "ltx2_i2v" else {}))
    single = load_generator(root).generate(**kw)
    assert single.audio is not None and single.audio.std() > 0
    for frames, audio in engine_on_ranks(root, kw, tmp_path):
        np.testing.assert_allclose(frames, single.frames, atol=1e-5, rtol=0)
        np.testing.assert_allclose(audio, single.audio, atol=1e-5, rtol=0)


def test_cli_nproc_sp_writes_the_video_with_its_audio(tiny_checkpoint, tmp_path):
    import av

    out = tmp_path / "sp.mp4"
    size = ("--height", 64, "--width", 64, "--num-frames", FRAMES, "--steps", 2)
    r = generate_on_sp2_ranks(tiny_checkpoint("ltx2"), out, *size)
    assert r.returncode == 0, r.stderr[-4000:]
    with av.open(str(out)) as c:
        assert len(list(c.decode(video=0))) == FRAMES
        assert c.streams.audio, "the mp4 has no audio track"


def test_audio_tokens_that_do_not_split_are_refused_before_any_work(tiny_checkpoint):
    """The request check (before the prompt is encoded), with the denoising stage set to 2-way SP (no processes
    needed: only the check runs): 9 frames give 320 video tokens, which split, and 9 audio tokens, which do not."""
    from spindle.api import load_generator
    from spindle.contracts.request import RequestError

    generator = load_generator(tiny_checkpoint("ltx2"))
    generator.pipeline.denoising.sp = 2
    with pytest.raises(RequestError, match=r"num_frames=9 gives 9 audio latent frames at 24 fps, not divisible by 2"):
        generator.generate(**dict(REQUEST, num_frames=9))
    with pytest.raises(RequestError, match=r"max_sequence_length=15 is not divisible by 2"):
        generator.generate(**dict(REQUEST, max_sequence_length=15))


# ---------------------------------------------------------------- training


def av_clips(root: Path, audio: bool) -> Path:
    """Two 17-frame 64x64 clips (with a stereo tone each when `audio`) and their captions."""
    root.mkdir(parents=True)
    t = np.arange(round(FRAMES / FPS * RATE)) / RATE
    for i, (caption, pitch) in enumerate([("a red circle hums", 440.0), ("a blue square beeps", 880.0)]):
        pixels = (np.random.default_rng(i).random((FRAMES, 64, 64, 3)) * 255).astype(np.uint8)
        tone = np.stack([0.5 * np.sin(2 * np.pi * pitch * t), 0.3 * np.sin(3 * np.pi * pitch * t)])
        write_video(root / f"{i}.mp4", pixels, fps=FPS, audio=tone if audio else None, sample_rate=RATE)
        (root / f"{i}.txt").write_text(caption)
    return root


def train_ltx2(root: Path, data: Path, out: Path, nproc: int, **more) -> None:
    overrides = dict(
        data__num_frames=FRAMES,
        data__resolution=[64, 64],
        model__max_text_length=16,
        train__max_steps=2,
        train__global_batch_size=2,
        train__micro_batch_size=2,
        train__adam_eps=1e-4,  # (tests/train/test_qwenimage_train.py: WELL_CONDITIONED)
        checkpoint__export=True,
        **more,
    )
    spindle_train(out, nproc, train_overrides(root, data, out, **overrides))


@pytest.mark.parametrize("audio", [False, True], ids=["video_only", "with_audio"])
def test_training_under_ulysses_equals_one_process(audio, tiny_checkpoint, tmp_path):
    root = tiny_checkpoint("ltx2")
    data = av_clips(tmp_path / "clips", audio)
    more = {"data__audio": True} if audio else {}
    train_ltx2(root, data, tmp_path / "single", 1, **more)
    train_ltx2(root, data, tmp_path / "sp2", 2, parallel__sp=2, parallel__dp_shard=1, **more)
    assert_same_training(tmp_path / "single", tmp_path / "sp2")
