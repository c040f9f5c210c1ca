"""Wan's training inputs follow diffusers' Wan pipeline and flow-matching scheduler, step by step.

Derived from diffusers' own code, not from Spindle's helpers: the latent normalisation is the inverse
of what `WanPipeline` applies before decoding, the timestep scale is the scheduler's
timesteps / sigmas, and the (noisy input, velocity target) pair is checked by letting the scheduler's
own Euler step walk from the noisy input back to the clean latents.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.conftest import TINY_FRAMES, encode_two_samples


@pytest.fixture(scope="module")
def condition(tiny_condition):
    return tiny_condition("wan")


def test_training_inputs_follow_diffusers_wan_conventions(condition, tiny_wan):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.train.tasks.flow_matching import load_transformer, sample_generator

    pipe = condition.pipe
    batch, cond = encode_two_samples(condition, ["a red circle", "a blue square moves up"], TINY_FRAMES)
    pixels = batch["pixels"]

    # latents: the VAE posterior mode, normalised with the inverse of WanPipeline's pre-decode step
    # (`latents / (1 / std) + mean`), so decoding a training latent gives the training video back
    vae = pipe.vae
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape)
    x0 = (vae.encode(pixels).latent_dist.mode() - mean) * inv_std
    torch.testing.assert_close(cond["latents"], x0, rtol=1e-6, atol=1e-6)
    embeds, _ = pipe.encode_prompt(batch["caption"], do_classifier_free_guidance=False, max_sequence_length=16)
    assert torch.equal(cond["prompt_embeds"], embeds)

    inputs = condition.training_inputs(cond, [sample_generator(0, 1, i) for i in batch["index"]])
    gens = [sample_generator(0, 1, i) for i in batch["index"]]
    sigmas = torch.cat([compute_density_for_timestep_sampling("uniform", 1, generator=gen) for gen in gens])
    noise = randn_tensor(tuple(x0.shape), generator=gens)
    torch.testing.assert_close(inputs["sigmas"], sigmas)

    # the scheduler's timestep scale: what WanPipeline passes the transformer at noise level sigma
    sched = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    sched.set_timesteps(num_inference_steps=4)
    scale = sched.timesteps / sched.sigmas[:-1]
    torch.testing.assert_close(scale, torch.full_like(scale, scale[0].item()))
    assert scale[0] == pipe.scheduler.config.num_train_timesteps
    torch.testing.assert_close(inputs["timestep"], sigmas * scale[0])
    assert inputs["timestep"].min() > 1.0, "Wan's transformer takes timesteps in [0, 1000), not sigmas"

    # noisy input and velocity target: one Euler step of the scheduler from sigma to 0 with the
    # target as the model output must land on the clean latents
    for i, sigma in enumerate(sigmas.tolist()):
        step = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=1.0)
        step.set_timesteps(sigmas=[sigma])
        assert step.sigmas[0].item() == pytest.approx(sigma, rel=1e-6)
        x_t = inputs["hidden_states"][i : i + 1]
        expected_x_t = (1 - sigma) * x0[i : i + 1] + sigma * noise[i : i + 1]
        torch.testing.assert_close(x_t, expected_x_t)
        landed = step.step(inputs["target"][i : i + 1], step.timesteps[0], x_t, return_dict=False)[0]
        torch.testing.assert_close(landed, x0[i : i + 1], rtol=1e-5, atol=1e-5)

    params = inspect.signature(load_transformer(tiny_wan).forward).parameters
    assert set(inputs) - {"target", "sigmas"} <= set(params)


def test_wan22_folders_without_what_they_need_are_refused_before_training(
    tiny_wan, shapes_videos, tmp_path, spindle_cli
):
    """A Wan2.2 A14B folder (transformer_2 + boundary_ratio) trains one expert, named by train.expert: without it
    `spindle train` exits 2 before any weight loads (the weights are gone here); an A14B or TI2V-5B folder forced
    onto Wan2.1's family is refused naming its own family."""
    import json
    import shutil

    from tests.conftest import train_overrides

    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}\n")
    cases = (
        ("a14b", {"boundary_ratio": 0.875, "transformer_2": ["diffusers", "WanTransformer3DModel"]}, (), "train.expert is required"),
        ("a14b-as-wan", {"boundary_ratio": 0.875}, ("model.family=wan",), "it is the wan22 family's"),
        ("ti2v-as-wan", {"expand_timesteps": True}, ("model.family=wan",), "it is the wan22_ti2v family's"),
    )  # fmt: skip
    for name, change, extra, message in cases:
        root = tmp_path / name
        shutil.copytree(tiny_wan, root)
        index = json.loads((root / "model_index.json").read_text())
        (root / "model_index.json").write_text(json.dumps({**index, **change}))
        for weights in root.glob("*/*.safetensors"):
            weights.unlink()
        overrides = train_overrides(root, shapes_videos, tmp_path / f"run-{name}")
        result = spindle_cli("train", cfg, *overrides, *extra)
        assert result.returncode == 2, result
        assert message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
