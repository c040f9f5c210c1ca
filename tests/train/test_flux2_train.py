"""FLUX.2 training beyond the conformance suite: a LoRA run of each FLUX.2 family (two steps, validation samples)
writes `export/lora/*.safetensors` that the stock pipeline's `load_lora_weights` loads, generating what Spindle's
engine generates with the same file; the training inputs follow the pipelines' latent conventions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator, load_job_config, train
from spindle.testing import conformance as suite
from tests.conftest import train_overrides


@pytest.mark.parametrize("name", ["flux2", "flux2_klein"])
def test_lora_trains_exports_and_loads_in_stock_diffusers(name, tiny_checkpoint, tmp_path):
    from diffusers import DiffusionPipeline

    from spindle.data.synthetic import make_shapes_image_dataset
    from spindle.registry import get_family

    family = get_family(name)
    tiny = tiny_checkpoint(name)
    text = family.conformance.text_tokens
    images = make_shapes_image_dataset(tmp_path / "images", num_images=4, size=(32, 32))
    overrides = dict(
        data__num_frames=1,
        data__resolution=[32, 32],
        model__max_text_length=text,
        train__max_steps=2,
        train__global_batch_size=2,
        train__lr=3e-2,  # two steps must move the adapters visibly
        train__lora="{rank: 4, alpha: 8}",
        train__validation={"every_steps": 2, "prompts": ["a red circle"], "num_inference_steps": 2},
    )
    result = train(load_job_config(None, train_overrides(tiny, images, tmp_path / "run", **overrides)))
    lora_dir = result.export_dir / "lora"
    assert sorted(p.name for p in lora_dir.glob("*.safetensors")) == ["pytorch_lora_weights.safetensors"]
    assert list((result.output_dir / "samples").rglob("*.png")), "no validation sample was written"

    request = dict(
        prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=2.5, max_sequence_length=text
    )
    pipe = DiffusionPipeline.from_pretrained(tiny)
    pipe.load_lora_weights(lora_dir)
    stock = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).images
    ours = load_generator(tiny, lora=str(lora_dir)).generate(**request, seed=0).frames
    assert np.abs(stock - ours).max() <= suite.PARITY_ATOL
    base = load_generator(tiny).generate(**request, seed=0).frames
    assert np.abs(base - ours).max() > 1e-4, "the LoRA changed nothing"


def test_training_inputs_follow_the_pipelines_latent_conventions(tiny_checkpoint):
    """The clean latents are the pipeline's `_encode_vae_image` (2x2-patchified, batch-norm normalized), the
    tokens its `_pack_latents`, the ids its 4-axis ones, and the noisy input the flow-matching interpolation of
    them with the noise the target subtracts them from."""
    from diffusers import Flux2Pipeline

    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import sample_generator

    family = get_family("flux2")
    condition = suite.condition_model(family, tiny_checkpoint("flux2"))
    batch = suite.training_batch(family)
    conditions = condition.encode(batch)
    pixels = batch["pixels"][:, :, 0]
    expected = condition.pipe._encode_vae_image(pixels, generator=None)
    torch.testing.assert_close(conditions["latents"], expected, atol=0, rtol=0)
    inputs = condition.training_inputs(conditions, [sample_generator(0, 0, i) for i in range(2)])
    x0 = Flux2Pipeline._pack_latents(expected)
    sigma = inputs["sigmas"].view(-1, 1, 1)
    noise = inputs["target"] + x0  # target = noise - x0
    torch.testing.assert_close(inputs["hidden_states"], (1 - sigma) * x0 + sigma * noise, atol=1e-6, rtol=0)
    assert inputs["img_ids"].shape == (2, x0.shape[1], 4) and inputs["txt_ids"].shape[-1] == 4
    torch.testing.assert_close(inputs["guidance"], torch.full((2,), 4.0))  # FLUX.2-dev's default, embedded
