"""Qwen-Image fine-tuning, what the conformance suite does not cover: training inputs follow
diffusers' Qwen-Image conventions step by step (chat template + drop, masked variable-length text,
packed latents, its shift), the text split under SP is checked, SP=2 with the CLI, the demo.
(Overfit, export round trip into stock QwenImagePipeline, refusing bad pixel shapes:
tests/conformance/test_conformance.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_TEXT, assert_same_training, encode_two_samples, train_cli

TEXT = TINY_TEXT  # model.max_text_length: divisible by the SP degree (the _cp_plan splits the text tokens)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwenimage")


@pytest.fixture(scope="module")
def condition(tiny_condition):
    return tiny_condition("qwenimage")


def test_training_inputs_follow_diffusers_qwenimage_conventions(condition, tiny):
    """What examples/dreambooth/train_dreambooth_lora_qwen_image.py computes, step by step, with the
    same noise; the masked padding to max_text_length leaves the transformer's output unchanged."""
    import inspect

    from diffusers import QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.train.tasks.flow_matching import load_transformer, sample_generator

    pipe = condition.pipe
    captions = ["a red circle", "a big blue square moves on the left"]
    batch, cond = encode_two_samples(condition, captions)
    pixels = batch["pixels"]

    vae = pipe.vae
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean, std = torch.tensor(vae.config.latents_mean).view(shape), torch.tensor(vae.config.latents_std).view(shape)
    x0 = ((vae.encode(pixels).latent_dist.mode() - mean) / std)[:, :, 0]
    torch.testing.assert_close(cond["latents"], x0, rtol=0, atol=0)
    embeds, mask = pipe.encode_prompt(captions, max_sequence_length=TEXT)
    lengths = mask.sum(1).tolist()
    assert lengths == [3 + 5, 8 + 5] and embeds.shape[1] == 13  # prompt + the template's suffix tokens
    assert cond["prompt_embeds"].shape == (2, TEXT, 32) and cond["prompt_embeds_mask"].shape == (2, TEXT)
    assert torch.equal(cond["prompt_embeds"][:, :13], embeds) and not cond["prompt_embeds"][:, 13:].any()
    assert cond["prompt_embeds_mask"].sum(1).tolist() == lengths

    gens = [sample_generator(0, 1, i) for i in (3, 5)]
    inputs = condition.training_inputs(cond, gens)

    # reference: same per-sample draws; uniform u shifted (exponential) with mu of 16x16/4 = 64 tokens
    gens = [sample_generator(0, 1, i) for i in (3, 5)]
    u = torch.cat([compute_density_for_timestep_sampling("uniform", 1, generator=gen) for gen in gens])
    mu = torch.tensor(calculate_shift(64, 256, 8192, 0.5, 0.9))
    sigmas = torch.exp(mu) / (torch.exp(mu) + (1 / u - 1))
    noise = randn_tensor((2, 1, 4, 16, 16), generator=gens)[:, 0]  # the pipeline's [B, 1, C, h, w] draw
    s = sigmas.view(-1, 1, 1, 1)
    pack = lambda x: QwenImagePipeline._pack_latents(x, 2, 4, 16, 16)  # noqa: E731
    torch.testing.assert_close(inputs["sigmas"], sigmas)
    torch.testing.assert_close(inputs["hidden_states"], pack((1 - s) * x0 + s * noise))
    torch.testing.assert_close(inputs["target"], pack(noise - x0))
    torch.testing.assert_close(inputs["timestep"], sigmas)  # the pipeline passes t / 1000
    assert inputs["img_shapes"] == [[(1, 8, 8)]] * 2 and inputs["hidden_states"].shape == (2, 64, 16)

    model = load_transformer(tiny)
    params = inspect.signature(model.forward).parameters
    assert set(inputs) - {"target", "sigmas"} <= set(params)  # exactly the transformer's forward kwargs
    kw = {k: v for k, v in inputs.items() if k not in ("target", "sigmas")}
    with torch.no_grad():
        padded = model(**kw, return_dict=False)[0]
        for i, n in enumerate(lengths):  # each sample alone, unpadded and unmasked, as at inference
            alone = {**kw, "hidden_states": kw["hidden_states"][i : i + 1], "timestep": kw["timestep"][i : i + 1]}
            alone.update(encoder_hidden_states=embeds[i : i + 1, :n], encoder_hidden_states_mask=None)
            alone["img_shapes"] = kw["img_shapes"][:1]
            torch.testing.assert_close(padded[i : i + 1], model(**alone, return_dict=False)[0], atol=1e-5, rtol=0)
    assert padded.shape == inputs["target"].shape


# Refusing video pixels and sizes the VAE x packing does not divide:
# tests/conformance/test_conformance.py::test_condition_model_rejects_bad_pixels


# adam_eps 1e-4, not the default 1e-8, so that the export comparison measures Spindle and not float32
# summation order. The layouts add attention and gradient contributions in a different order, and AdamW's
# update lr * g / (|g| + eps) has slope up to lr / eps in g: at 1e-8 (1e5 at lr 1e-3) the rounding noise of
# a gradient that is about 0 becomes a visible weight difference: ring=2 left 2.58e-6 of the 1e-5 export
# tolerance (sp=2 1.45e-6) with losses equal to 7.5e-8 and grad norms exactly. At 1e-4 the slope is at most
# 10 and the same runs differ by 6.0e-8 (ring) and 3.0e-8 (sp); Adam still moves every weight whose
# gradient is >> 1e-4 by ~lr a step, so a missing or misplaced gradient still shows.
# (tests/distributed/test_expert_lora_multimodal.py says more.)
WELL_CONDITIONED = {"train__adam_eps": 1e-4}


@pytest.fixture(scope="module")
def single_run(tiny, shapes_images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qwen_single") / "single"
    train_cli(tiny, shapes_images, out, nproc=1, **WELL_CONDITIONED)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"parallel__sp": 2}, {"parallel__ring": 2}], ids=["sp2", "ring2"])
def test_sequence_parallel_training_equals_one_process(tiny, shapes_images, single_run, tmp_path, layout):
    """Ulysses SP=2 and ring attention ring=2 through QwenImageTransformer2DModel's own `_cp_plan` (image
    and text tokens, the text mask and the RoPE tables split over 2 ranks; under ring every KV chunk is
    attended with its own part of the text mask) train exactly like one process."""
    train_cli(tiny, shapes_images, tmp_path / "sp2", nproc=2, parallel__dp_shard=1, **WELL_CONDITIONED, **layout)
    assert_same_training(single_run, tmp_path / "sp2")


def test_text_length_not_divisible_by_sp_is_named(condition, tiny):
    """Qwen-Image's `_cp_plan` splits the text tokens at its first block: a max_text_length the SP
    group does not divide is an error naming the input before diffusers fails inside."""
    from spindle.distributed.context_parallel import check_split_inputs
    from spindle.train.tasks.flow_matching import load_transformer, sample_generator

    cond = {
        "latents": torch.zeros(1, 4, 16, 16),
        "prompt_embeds": torch.zeros(1, 15, 32),
        "prompt_embeds_mask": torch.ones(1, 15, dtype=torch.long),
    }
    inputs = condition.training_inputs(cond, [sample_generator(0, 0, 0)])
    model = load_transformer(tiny)
    with pytest.raises(ValueError, match=r"splits the input 'encoder_hidden_states' along dim 1, which has length 15"):
        check_split_inputs(model, 2, inputs)
    with pytest.raises(ValueError, match=r"'hidden_states' along dim 1, which has length 64, not divisible by the 3"):
        check_split_inputs(model, 3, inputs)  # the text divides by 3, the 8x8 image tokens do not
    padded = {
        **cond,
        "prompt_embeds": torch.zeros(1, 16, 32),
        "prompt_embeds_mask": torch.ones(1, 16, dtype=torch.long),
    }
    check_split_inputs(model, 2, condition.training_inputs(padded, [sample_generator(0, 0, 0)]))
