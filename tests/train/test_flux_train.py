"""Flux fine-tuning, what the conformance suite does not cover: training inputs follow diffusers'
Flux training conventions step by step, a static shift from the config replaces the resolution
shift, SP=2 with the CLI equals one process, the demo."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_same_training, encode_two_samples, train_cli


@pytest.fixture(scope="module")
def condition(tiny_condition):
    return tiny_condition("flux")


def test_training_inputs_follow_diffusers_flux_conventions(condition, tiny_flux):
    """What examples/dreambooth/train_dreambooth_flux.py computes, step by step, with the same noise."""
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.train.tasks.flow_matching import sample_generator

    pipe = condition.pipe
    batch, cond = encode_two_samples(condition, ["a red circle", "a blue square on the left"])
    pixels = batch["pixels"]

    vae = pipe.vae
    x0 = (vae.encode(pixels[:, :, 0]).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    torch.testing.assert_close(cond["latents"], x0, rtol=0, atol=0)
    embeds, pooled, _ = pipe.encode_prompt(batch["caption"], None, max_sequence_length=16)
    assert torch.equal(cond["prompt_embeds"], embeds) and torch.equal(cond["pooled_prompt_embeds"], pooled)

    gens = [sample_generator(0, 1, i) for i in batch["index"]]
    inputs = condition.training_inputs(cond, gens)

    # reference: same per-sample draws, uniform u shifted with mu of the 16x16/4 = 64 image tokens
    gens = [sample_generator(0, 1, i) for i in batch["index"]]
    u = torch.cat([compute_density_for_timestep_sampling("uniform", 1, generator=gen) for gen in gens])
    mu = calculate_shift(64, 256, 4096, 0.5, 1.15)
    sigmas = torch.exp(torch.tensor(mu)) / (torch.exp(torch.tensor(mu)) + (1 / u - 1))
    noise = randn_tensor(tuple(x0.shape), generator=gens)
    s = sigmas.view(-1, 1, 1, 1)
    pack = lambda x: FluxPipeline._pack_latents(x, 2, 4, 16, 16)  # noqa: E731
    torch.testing.assert_close(inputs["sigmas"], sigmas)
    assert (inputs["sigmas"] > u).all()  # mu > 0: shifted towards noise
    torch.testing.assert_close(inputs["hidden_states"], pack((1 - s) * x0 + s * noise))
    torch.testing.assert_close(inputs["target"], pack(noise - x0))
    torch.testing.assert_close(inputs["timestep"], sigmas)  # the transformer multiplies by 1000 itself
    assert torch.equal(inputs["guidance"], torch.full((2,), 3.5))
    assert torch.equal(inputs["img_ids"], FluxPipeline._prepare_latent_image_ids(2, 8, 8, "cpu", torch.float32))
    assert torch.equal(inputs["txt_ids"], torch.zeros(16, 3))
    assert inputs["hidden_states"].shape == (2, 64, 16)

    # exactly the transformer's forward kwargs (+ target, sigmas)
    import inspect

    from spindle.export.diffusers import load_transformer

    params = inspect.signature(load_transformer(tiny_flux).forward).parameters
    assert set(inputs) - {"target", "sigmas"} <= set(params)


def test_static_shift_from_config_replaces_resolution_shift(condition):
    from spindle.config import TimestepConfig
    from spindle.train.tasks.flow_matching import sample_generator

    cond = {
        "latents": torch.zeros(1, 4, 16, 16),
        "prompt_embeds": torch.zeros(1, 16, 32),
        "pooled_prompt_embeds": torch.zeros(1, 32),
    }
    saved = condition.timestep_sampling
    try:
        condition.timestep_sampling = TimestepConfig(shift=3.0)
        static = condition.training_inputs(cond, [sample_generator(0, 0, 0)])["sigmas"]
        condition.timestep_sampling = TimestepConfig(shift=1.0)
        dynamic = condition.training_inputs(cond, [sample_generator(0, 0, 0)])["sigmas"]
    finally:
        condition.timestep_sampling = saved
    u = torch.rand(1, generator=sample_generator(0, 0, 0))
    torch.testing.assert_close(static, 3 * u / (1 + 2 * u))
    assert not torch.allclose(static, dynamic)


# Refusing video pixels and sizes the VAE x packing does not divide, overfitting (with the token
# throughput) and the export round trip into stock FluxPipeline (Spindle on the export equal to it):
# tests/conformance/test_conformance.py (test_condition_model_rejects_bad_pixels, test_overfits_and_exports_for_stock_diffusers).


# ------------------------------------------------------------------ multi-process (torchrun, gloo)


@pytest.mark.slow
def test_sequence_parallel_training_equals_one_process(tiny_flux, shapes_images, tmp_path):
    """SP=2 through FluxTransformer2DModel's own `_cp_plan` (image tokens, text tokens and both id
    tensors split over 2 ranks) trains exactly like one process: losses, grad norms, weights."""
    train_cli(tiny_flux, shapes_images, tmp_path / "single", nproc=1)
    train_cli(tiny_flux, shapes_images, tmp_path / "sp2", nproc=2, parallel__sp=2, parallel__dp_shard=1)
    assert_same_training(tmp_path / "single", tmp_path / "sp2")
