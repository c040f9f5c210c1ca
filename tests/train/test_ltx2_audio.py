"""LTX-2 trained on videos with their audio (`data.audio`): tiny mp4s with a stereo AAC track (9 frames at 24 fps,
64x64, 0.375 s of sound) written with PyAV.

- the training inputs equal a stock computation: the audio latents are the stock audio VAE's encoding of the
  clip's waveform (its log-mel spectrogram computed by transformers' reference STFT), packed and normalised by
  the pipeline's own helpers; the noised pair uses the video's sigma and noise drawn after the video's; the
  task's loss is the hand-written flow-matching loss over both streams of a direct stock transformer call;
- two LoRA steps through `spindle train` (text- and image-to-video) export a LoRA that the stock pipeline's
  `load_lora_weights` loads, whose audio
  branch adapters were trained (the last block's audio feed-forward, which the video-only rule leaves at zero:
  tests/train/test_ltx2.py) and change the stock pipeline's audio;
- `spindle precompute` caches the audio latents, which a run on the cache trains on;
- a clip without an audio track, with too short a track, or of the wrong duration, and an image, are named
  (file: reason) before the model is built; families without an audio stream, and frame buckets, refuse
  data.audio before launch.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from spindle.data.media import write_image, write_video
from tests.conftest import train_video_lora

RATE, FRAMES, FPS = 16000, 9, 24
SECONDS = FRAMES / FPS


def tone(seconds: float, pitch: float) -> np.ndarray:
    """A stereo tone [2, samples] (the channels differ)."""
    t = np.arange(round(seconds * RATE)) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * pitch * t), 0.3 * np.sin(2 * np.pi * 1.5 * pitch * t)])


def clip(path: Path, caption: str, seed: int, audio: np.ndarray | None, frames: int = FRAMES) -> Path:
    pixels = (np.random.default_rng(seed).random((frames, 64, 64, 3)) * 255).astype(np.uint8)
    write_video(path, pixels, fps=FPS, audio=audio, sample_rate=RATE)
    path.with_suffix(".txt").write_text(caption)
    return path


@pytest.fixture(scope="module")
def av_clips(tmp_path_factory) -> Path:
    """Two 9-frame clips with their soundtracks."""
    root = tmp_path_factory.mktemp("av_clips")
    clip(root / "a.mp4", "a red circle hums", 0, tone(SECONDS, 440))
    clip(root / "b.mp4", "a blue square beeps", 1, tone(SECONDS, 880))
    return root


def job(root: Path, data: Path, out: Path, **more):
    from spindle.api import load_job_config
    from spindle.testing.multiprocess import dotted_overrides

    base = {
        "model.path": root,
        "model.max_text_length": 16,
        "data.path": data,
        "data.resolution": [64, 64],
        "data.num_frames": FRAMES,
        "data.audio": True,
        "train.output_dir": out,
        "train.global_batch_size": 2,
        "train.micro_batch_size": 2,
        "checkpoint.resume": "none",
    }
    return load_job_config(None, dotted_overrides(base, **more))


def stock_mel(wave: np.ndarray, config) -> torch.Tensor:
    """transformers' reference STFT (numpy) of each channel: the LTX-2 audio processor's log-mel [C, frames, mel]."""
    from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

    filters = mel_filter_bank(513, config.mel_bins, 0.0, config.sample_rate / 2, config.sample_rate, "slaney", "slaney")
    mels = [
        spectrogram(
            channel,
            window_function(1024, "hann"),
            frame_length=1024,
            hop_length=config.mel_hop_length,
            power=1.0,
            mel_filters=filters,
            mel_floor=1e-5,
            log_mel="log",
            # float64 as Spindle's: in float32 the STFT's rounding (~1e-7 of the tone's energy) is a large share of
            # a quiet band near the 1e-5 floor, and its log then differs by more than the 1e-5 the test allows
            dtype=np.float64,
        )
        for channel in wave
    ]
    return torch.from_numpy(np.stack(mels)).float().transpose(1, 2)


def test_training_inputs_and_loss_equal_a_stock_computation(tiny_checkpoint, av_clips, tmp_path):
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.data.datasets import collate
    from spindle.distributed.mesh import ParallelDims, build_mesh
    from spindle.ops.flow_matching import sample_sigmas
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import FlowMatchingTask, dit_data, sample_generator

    root, family = tiny_checkpoint("ltx2"), get_family("ltx2")
    cfg = job(root, av_clips, tmp_path / "run")
    task = FlowMatchingTask(cfg, family, build_mesh(ParallelDims()), torch.device("cpu"), "no")
    dataset = dit_data(cfg, family).dataset  # the task's own dataset: each clip with its soundtrack
    batch = collate([dataset[0], dataset[1]])
    assert batch["audio"].shape == (2, 2, round(SECONDS * RATE))
    pipe = task.condition.pipe
    vae = pipe.audio_vae

    # the audio latents: the stock audio VAE's mode of the clip's mel spectrogram, the pipeline's pack + normalise
    conditions = task.condition.encode(batch)
    latent_frames = round(SECONDS * RATE / 160 / 4)  # LTX2Pipeline's count for 9 frames at 24 fps
    mel = torch.stack([stock_mel(w.numpy(), vae.config) for w in batch["audio"]])
    mode = vae.encode(mel).latent_dist.mode()[:, :, :latent_frames]
    a0 = pipe._normalize_audio_latents(pipe._pack_audio_latents(mode), vae.latents_mean, vae.latents_std)
    assert a0.shape == (2, latent_frames, 4) and a0.std() > 0.1
    torch.testing.assert_close(conditions["audio_latents"], a0, rtol=0, atol=1e-5)

    # the noised pair: one sigma per sample for both streams, the audio noise drawn after the video's
    step = 3
    transformer = LTX2VideoTransformer3DModel.from_pretrained(root / "transformer").eval()
    inputs = task.training_inputs(transformer, batch, step)
    generators = [sample_generator(cfg.train.seed, step, int(i)) for i in batch["index"]]
    sigmas = sample_sigmas(task.condition.timestep_sampling, generators)
    x0 = pipe._pack_latents(conditions["latents"])
    video_noise = randn_tensor(tuple(x0.shape), generator=generators)
    audio_noise = randn_tensor(tuple(a0.shape), generator=generators)
    s = sigmas.view(-1, 1, 1)
    noisy, audio = (1 - s) * x0 + s * video_noise, (1 - s) * a0 + s * audio_noise
    model_inputs = inputs.model_inputs
    torch.testing.assert_close(model_inputs["hidden_states"], noisy, rtol=0, atol=1e-5)
    torch.testing.assert_close(model_inputs["audio_hidden_states"], audio, rtol=0, atol=1e-5)
    torch.testing.assert_close(model_inputs["audio_timestep"], sigmas * 1000)
    torch.testing.assert_close(model_inputs["timestep"], sigmas * 1000)
    assert model_inputs["audio_num_frames"] == latent_frames

    # the loss: each stream's mean squared error to its velocity, summed, of a direct stock call
    with torch.no_grad():
        video_pred, audio_pred = transformer(
            hidden_states=noisy,
            audio_hidden_states=audio,
            encoder_hidden_states=conditions["prompt_embeds"],
            audio_encoder_hidden_states=conditions["audio_prompt_embeds"],
            timestep=sigmas * 1000,
            audio_timestep=sigmas * 1000,
            sigma=sigmas * 1000,
            audio_sigma=sigmas * 1000,
            encoder_attention_mask=conditions["prompt_mask"],
            audio_encoder_attention_mask=conditions["prompt_mask"],
            num_frames=conditions["latents"].shape[2],
            height=8,
            width=8,
            fps=24.0,
            audio_num_frames=latent_frames,
            use_cross_timestep=True,
            return_dict=False,
        )
        video_loss = ((video_pred - (video_noise - x0)) ** 2).mean((1, 2))
        audio_loss = ((audio_pred - (audio_noise - a0)) ** 2).mean((1, 2))
        out = task.forward(transformer, batch, step)
    assert out.samples == 2 and (audio_loss > 1e-2).all()  # the audio term counts
    torch.testing.assert_close(out.loss_sum, (video_loss + audio_loss).sum(), rtol=0, atol=1e-5)


def audio_adapters(lora_dir: Path, block: int) -> dict[str, torch.Tensor]:
    """The LoRA's up-projections (lora_B, zero at the start) of block `block`'s audio feed-forward."""
    from safetensors.torch import load_file

    weights = load_file(lora_dir / "pytorch_lora_weights.safetensors")
    found = {k: v for k, v in weights.items() if f"transformer_blocks.{block}.audio_ff." in k and "lora_B" in k}
    assert found, sorted(weights)[:8]
    return found


def last_block(root: Path) -> int:
    import json

    return json.loads((root / "transformer" / "config.json").read_text())["num_layers"] - 1


@pytest.mark.parametrize("name", ["ltx2", "ltx2_i2v"])
def test_lora_trains_the_audio_branch_and_loads_in_stock_diffusers(name, tiny_checkpoint, av_clips, tmp_path):
    from diffusers import DiffusionPipeline

    from spindle.models.shared.conformance import noise_image

    root = tiny_checkpoint(name)
    lora_dir = train_video_lora(root, tmp_path, videos=av_clips, data__audio=True)
    # the last block's audio feed-forward reaches only the audio output: it trains only on the audio loss
    assert all(v.abs().max() > 1e-4 for v in audio_adapters(lora_dir, last_block(root)).values())

    request = dict(
        prompt="a red circle hums",
        height=64,
        width=64,
        num_frames=FRAMES,
        num_inference_steps=2,
        max_sequence_length=16,
    )
    request |= dict(image=noise_image(64, 64), image_crf=0) if name == "ltx2_i2v" else {}  # (its first frame)
    pipe = DiffusionPipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    base = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).audio
    pipe.load_lora_weights(lora_dir)
    tuned = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).audio
    assert base.shape == tuned.shape and (tuned - base).abs().max() > 1e-4, "the LoRA left the audio unchanged"


def test_precomputed_conditions_carry_the_audio_latents(tiny_checkpoint, av_clips, tmp_path):
    import json

    from safetensors.torch import load_file

    from spindle.commands.precompute import precompute
    from spindle.data.datasets import collate
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import dit_data

    root = tiny_checkpoint("ltx2")
    cfg = job(root, av_clips, tmp_path / "run", model__max_text_length=16)
    cache = tmp_path / "cache"
    manifest = precompute(cfg, cache)
    assert manifest is not None and json.loads(manifest.read_text())["settings"]["audio"] is True
    family = get_family("ltx2")
    dataset = dit_data(cfg, family, captions=False).dataset
    condition = family.condition_model_cls().from_pretrained(root, max_text_length=16)
    expected = condition.encode(collate([dataset.load(1)]))["audio_latents"][0]
    cached = load_file(cache / "samples" / "00000001.safetensors")["audio_latents"]
    torch.testing.assert_close(cached, expected, rtol=0, atol=0)

    # a run on the cache trains the audio stream from it (no audio VAE, no decoding)
    lora_dir = train_video_lora(root, tmp_path / "cached", videos=av_clips, data__audio=True, data__precomputed=cache)
    assert all(v.abs().max() > 1e-4 for v in audio_adapters(lora_dir, last_block(root)).values())
    # a cache written without data.audio holds no audio latents: refused for an audio run
    with pytest.raises(ValueError, match="audio"):
        precompute(job(root, av_clips, tmp_path / "run2", data__audio=False), tmp_path / "plain")
        train_video_lora(
            root, tmp_path / "plain_run", videos=av_clips, data__audio=True, data__precomputed=tmp_path / "plain"
        )


def test_a_bad_audio_track_is_named_before_the_model_is_built(tiny_checkpoint, tmp_path, monkeypatch):
    from spindle.api import train
    from spindle.data.media_check import DataCheckError
    from spindle.train.tasks.flow_matching import FlowMatchingTask

    data = tmp_path / "clips"
    clip(data / "good.mp4", "fine", 0, tone(SECONDS, 440))
    silent = clip(data / "silent.mp4", "no sound", 1, None)
    short = clip(data / "short.mp4", "cut sound", 2, tone(0.1, 440))
    long = clip(data / "long.mp4", "too long", 3, tone(17 / FPS, 440), frames=17)
    still = write_image(data / "still.png", np.zeros((64, 64, 3), np.uint8))
    still.with_suffix(".txt").write_text("an image")

    def never(self):
        raise AssertionError("the model was built before the data was checked")

    monkeypatch.setattr(FlowMatchingTask, "build_model", never)
    with pytest.raises(DataCheckError) as error:
        train(job(tiny_checkpoint("ltx2"), data, tmp_path / "run", train__max_steps=1))
    problems = {p.path: p.reason for p in error.value.problems}
    assert set(problems) == {silent, short, long, still}
    assert "an image has no sound" in problems[still]
    assert "no audio track" in problems[silent]
    # (0.1 s of sound decodes to whole AAC frames of 1024 samples: 0.128 s)
    assert re.search(r"the audio track lasts 0\.1\d\d s, shorter than the clip's 0\.375 s", problems[short])
    assert "the video lasts 0.708 s (17 frames at 24 fps)" in problems[long] and "0.375 s" in problems[long]
    assert f"{silent}: no audio track" in str(error.value)


@pytest.mark.parametrize(
    "name,more,message",
    [
        ("wan", {}, r"data.audio: WanConditionModel has no audio stream to train; remove data.audio"),
        ("ltx2", {"data__buckets": True}, r"data.audio takes clips of exactly data.num_frames .* remove data.buckets"),
    ],
)
def test_audio_training_is_refused_before_launch_where_it_cannot_run(name, more, message, tiny_checkpoint, tmp_path):
    from spindle.config import ConfigError
    from spindle.distributed.mesh import ParallelDims
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import FlowMatchingTask

    cfg = job(tiny_checkpoint(name), tmp_path, tmp_path / "run", **more)
    with pytest.raises(ConfigError, match=message):
        FlowMatchingTask.check_plan(cfg, get_family(name), ParallelDims().resolve(1))
