"""HunyuanVideo-1.5 (text- and image-to-video) beyond the conformance suite: a two-step LoRA run on a small video
dataset (64x64, 9 frames; image-to-video conditioned on each clip's first frame) writes `export/lora/pytorch_lora_weights.safetensors`, which stock diffusers loads into the stock pipeline's
transformer (`HunyuanVideo15Pipeline` has no `load_lora_weights`: `transformer.load_lora_adapter(...,
prefix="transformer")` reads the same layout), generating what Spindle's engine generates with it; the training
inputs follow the pipeline's conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator
from spindle.testing import conformance as suite
from tests.conftest import train_video_lora

NAME = "hunyuan_video_1_5"


@pytest.mark.parametrize("name", [NAME, "hunyuan_video_1_5_i2v"])
def test_lora_trains_exports_and_loads_in_stock_diffusers(name, tiny_checkpoint, tmp_path):
    from diffusers import DiffusionPipeline

    from spindle.models.shared.conformance import noise_image

    tiny = tiny_checkpoint(name)
    lora_dir = train_video_lora(tiny, tmp_path)
    assert 'pipe.transformer.load_lora_adapter("' in (lora_dir / "README.md").read_text()

    request = dict(prompt="a red circle", num_frames=9, num_inference_steps=2)
    # image-to-video: the size is the image's bucket (64x64 for a square image on the tiny model)
    request |= dict(height=64, width=64) if name == NAME else dict(image=noise_image(64, 64))
    ours = load_generator(tiny, lora=str(lora_dir)).generate(**request, seed=0).frames
    pipe = DiffusionPipeline.from_pretrained(tiny)
    pipe.transformer.load_lora_adapter(lora_dir / "pytorch_lora_weights.safetensors", prefix="transformer")
    stock = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).frames
    assert np.abs(stock - ours).max() <= suite.PARITY_ATOL
    base = load_generator(tiny).generate(**request, seed=0).frames
    assert np.abs(base - ours).max() > 1e-4, "the LoRA changed nothing"


def test_training_inputs_follow_the_pipelines_conventions(tiny_checkpoint):
    """The clean latents are the VAE mode x scaling_factor (what the pipeline's decode divides by), the
    transformer's input the flow-matching interpolation followed by text-to-video's zero condition latents and
    mask, the timestep sigma x 1000, the image embeddings the pipeline's zeros."""
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import sample_generator

    family = get_family(NAME)
    condition = suite.condition_model(family, tiny_checkpoint(NAME))
    batch = suite.training_batch(family)
    conditions = condition.encode(batch)
    vae = condition.pipe.vae
    # (one video per encode: the VAE's attention builds its causal mask for one)
    modes = [vae.encode(video[None]).latent_dist.mode() for video in batch["pixels"]]
    expected = torch.cat(modes) * vae.config.scaling_factor
    torch.testing.assert_close(conditions["latents"], expected, atol=0, rtol=0)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    channels = expected.shape[1]
    sigma = inputs["sigmas"].view(-1, 1, 1, 1, 1)
    noise = inputs["target"] + expected  # target = noise - x0
    hidden = inputs["hidden_states"]
    torch.testing.assert_close(hidden[:, :channels], (1 - sigma) * expected + sigma * noise, atol=1e-6, rtol=0)
    assert hidden.shape[1] == 2 * channels + 1 and not hidden[:, channels:].any()
    torch.testing.assert_close(inputs["timestep"], inputs["sigmas"] * 1000)
    assert inputs["image_embeds"].shape[1] == condition.pipe.vision_num_semantic_tokens
    assert not inputs["image_embeds"].any()
