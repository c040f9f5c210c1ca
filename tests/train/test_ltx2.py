"""LTX-2 (text- and image-to-video) beyond the conformance suite: the audio track (equal to the stock pipeline's,
written into the mp4 as an audio stream of its length), a two-step LoRA run on a small video dataset (64x64, 9
frames; image-to-video conditioned on each clip's first frame) whose `export/lora/pytorch_lora_weights.safetensors`
the stock pipeline's `load_lora_weights` loads (generating what Spindle's engine generates with it), and the
video-only training inputs' audio rule."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.testing import conformance as suite
from spindle.testing.specs import dit_spec
from tests.conftest import train_video_lora
from tests.train.test_ltx2_audio import audio_adapters, last_block

NAME = "ltx2"
I2V = "ltx2_i2v"


def stock(root, request, **kw):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(root)
    pipe.set_progress_bar_config(disable=True)
    return pipe, pipe(**request, **kw, output_type="np", generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,case", [(NAME, "defaults"), (NAME, "cfg"), (I2V, "defaults")])
def test_audio_equals_the_stock_pipeline_and_is_written_into_the_mp4(name, case, tiny_checkpoint, tmp_path):

    tiny = tiny_checkpoint(name)
    request = {k: v for k, v in dit_spec(name).parity_cases[case].items() if k != "seed"}
    pipe, reference = stock(tiny, request)
    result = load_generator(tiny).generate(**request, seed=0)
    audio = reference.audio.float().numpy()
    assert result.audio is not None and result.audio.shape == audio.shape and audio.std() > 1e-3
    assert np.abs(result.audio - audio).max() <= suite.PARITY_ATOL
    assert np.abs(result.frames - reference.frames).max() <= suite.PARITY_ATOL
    assert result.sample_rate == pipe.vocoder.config.output_sampling_rate

    (path,) = result.save(tmp_path / "clip.mp4")
    with av.open(str(path)) as container:
        (video,), (sound,) = container.streams.video, container.streams.audio
        assert video.frames == request["num_frames"]
        assert (sound.rate, sound.channels) == (result.sample_rate, audio.shape[1])
        # the stream's duration is the waveform's length (to the container's millisecond: AAC's priming and padding are trimmed by its edit list)
        assert sound.duration * sound.time_base == pytest.approx(audio.shape[-1] / result.sample_rate, abs=1e-3)


@pytest.mark.parametrize("name", [NAME, I2V])
def test_lora_trains_exports_and_loads_in_stock_diffusers(name, tiny_checkpoint, tmp_path):
    from spindle.models.shared.conformance import noise_image

    tiny = tiny_checkpoint(name)
    lora_dir = train_video_lora(tiny, tmp_path)
    # the video-only rule: the last block's audio feed-forward reaches only the audio output, which no loss reads
    # (trained with data.audio: tests/train/test_ltx2_audio.py)
    assert all(not v.any() for v in audio_adapters(lora_dir, last_block(tiny)).values())

    # (the LoRA records its trained text length, 16: the engine's default with it, given to the stock pipeline too)
    request = dict(
        prompt="a red circle", height=64, width=64, num_frames=9, num_inference_steps=2, max_sequence_length=16
    )
    request |= dict(image=noise_image(64, 64), image_crf=0) if name == I2V else {}
    ours = load_generator(tiny, lora=str(lora_dir)).generate(**request, seed=0)
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny)
    pipe.load_lora_weights(lora_dir)
    reference = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0))
    assert np.abs(reference.frames - ours.frames).max() <= suite.PARITY_ATOL
    assert np.abs(reference.audio.float().numpy() - ours.audio).max() <= suite.PARITY_ATOL
    base = load_generator(tiny).generate(**request, seed=0).frames
    assert np.abs(base - ours.frames).max() > 1e-4, "the LoRA changed nothing"


def test_training_inputs_follow_the_pipelines_conventions(tiny_checkpoint):
    """The clean latents are the pipeline's normalised VAE mode packed into its tokens, the video input the
    flow-matching interpolation at timestep sigma x 1000; the audio stream pure noise at timestep 1000 (the
    video-only rule), the audio frames the clip's duration at the audio VAE's rate."""
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import sample_generator

    family = get_family(NAME)
    condition = suite.condition_model(family, tiny_checkpoint(NAME))
    batch = suite.training_batch(family)
    conditions = condition.encode(batch)
    pipe = condition.pipe
    vae = pipe.vae
    mode = vae.encode(batch["pixels"]).latent_dist.mode()
    expected = pipe._normalize_latents(mode, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(conditions["latents"], expected, atol=0, rtol=0)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    x0 = pipe._pack_latents(expected)
    sigma = inputs["sigmas"].view(-1, 1, 1)
    noise = inputs["target"] + x0  # target = noise - x0
    torch.testing.assert_close(inputs["hidden_states"], (1 - sigma) * x0 + sigma * noise, atol=1e-6, rtol=0)
    torch.testing.assert_close(inputs["timestep"], inputs["sigmas"] * 1000)
    assert (inputs["audio_timestep"] == 1000).all() and (inputs["audio_sigma"] == 1000).all()
    frames = batch["pixels"].shape[2]
    assert inputs["audio_num_frames"] == round(frames / 24 * 16000 / 160 / 4)
    assert inputs["audio_hidden_states"].shape == (2, inputs["audio_num_frames"], 4)


def test_image_to_video_training_keeps_the_first_frame_clean(tiny_checkpoint, monkeypatch):
    """Image-to-video: the first latent frame's tokens are the normalised VAE mode of the first frame alone (after
    the pipeline's H.264 re-compression at CRF 33), at timestep 0 and out of the loss; the rest is text-to-video's."""
    from diffusers.pipelines.ltx2 import utils

    from spindle.data.media import tensor_to_image
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import sample_generator

    # x264 is not bit-reproducible under load (spindle.data.media.write_video): record the re-compression's call and
    # leave the image as it is, so the expected latents are exact
    calls = []
    monkeypatch.setattr(utils, "apply_image_conditioning_crf", lambda image, crf: calls.append(crf) or image)
    family = get_family(I2V)
    condition = suite.condition_model(family, tiny_checkpoint(I2V))
    batch = suite.training_batch(family)
    conditions = condition.encode(batch)
    assert calls == [33, 33]
    pipe = condition.pipe
    image = tensor_to_image(batch["pixels"][0, :, 0])
    pixels = pipe.video_processor.preprocess(image, height=64, width=64).unsqueeze(2)
    mode = pipe.vae.encode(pixels).latent_dist.mode()
    expected = pipe._normalize_latents(mode, pipe.vae.latents_mean, pipe.vae.latents_std)
    torch.testing.assert_close(conditions["first_frame"][:1], expected, atol=1e-6, rtol=0)  # (batched VAE: 1e-6)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    tokens = expected.shape[-2] * expected.shape[-1]
    first = pipe._pack_latents(conditions["first_frame"])
    torch.testing.assert_close(inputs["hidden_states"][:, :tokens], first, atol=0, rtol=0)
    assert not inputs["timestep"][:, :tokens].any() and (inputs["loss_mask"][:, :tokens] == 0).all()
    rest = inputs["timestep"][:, tokens:]
    torch.testing.assert_close(rest, (inputs["sigmas"] * 1000)[:, None].expand_as(rest))
    assert (inputs["loss_mask"][:, tokens:] == 1).all()
