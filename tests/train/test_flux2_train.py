"""FLUX.2 training beyond the conformance suite: a LoRA run of each FLUX.2 family and of Z-Image (two steps,
validation samples) writes `export/lora/*.safetensors` (diffusers' file and the original/ComfyUI layout: BFL's,
Tongyi's fused-qkv Z-Image) that the stock pipeline's
`load_lora_weights` loads, generating what Spindle's engine generates; the training inputs follow the pipelines'
latent conventions; edit pairs train with their sources as reference tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spindle.api import load_generator, load_job_config, train
from spindle.testing import conformance as suite
from spindle.testing.specs import dit_spec
from tests.conftest import train_overrides


@pytest.mark.parametrize("name", ["flux2", "flux2_klein", "z_image"])
def test_lora_trains_exports_and_loads_in_stock_diffusers(name, tiny_checkpoint, tmp_path):
    from diffusers import DiffusionPipeline

    from spindle.data.synthetic import make_shapes_image_dataset

    tiny = tiny_checkpoint(name)
    text = dit_spec(name).text_tokens
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
    files = ["original_layout_lora.safetensors", "pytorch_lora_weights.safetensors"]
    assert sorted(p.name for p in lora_dir.glob("*.safetensors")) == files
    assert list((result.output_dir / "samples").rglob("*.png")), "no validation sample was written"

    request = dict(
        prompt="a red circle", height=32, width=32, num_inference_steps=2, guidance_scale=2.5, max_sequence_length=text
    )
    ours = load_generator(tiny, lora=str(lora_dir)).generate(**request, seed=0).frames
    for weight_name in files:  # diffusers' own file, and the BFL/ComfyUI layout read by diffusers' kohya reader
        pipe = DiffusionPipeline.from_pretrained(tiny)
        pipe.load_lora_weights(lora_dir, weight_name=weight_name)
        stock = pipe(**request, output_type="np", generator=torch.Generator().manual_seed(0)).images
        assert np.abs(stock - ours).max() <= suite.PARITY_ATOL, weight_name
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


def test_edit_pair_sources_are_the_pipelines_reference_tokens(tiny_checkpoint):
    """An edit pair's sources become the tokens and ids the pipeline's `prepare_image_latents` makes of the same
    pixels, after the target's; the loss reads the target's tokens only (`target_prediction`)."""
    from spindle.registry import get_family
    from spindle.train.tasks.flow_matching import sample_generator

    family = get_family("flux2_klein")
    condition = suite.condition_model(family, tiny_checkpoint("flux2_klein"))
    batch = suite.training_batch(family)
    batch["images"] = torch.rand(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    inputs = condition.training_inputs(condition.encode(batch), [sample_generator(0, 0, i) for i in range(2)])
    tokens = inputs["target"].shape[1]
    assert tokens == 8 * 8  # 32 x 32 pixels: VAE x2, 2x2 patches, a token each
    # (the pipeline encodes one request's references: compare each sample's own)
    for sample in range(2):
        expected, ids = condition.pipe.prepare_image_latents(
            [batch["images"][sample : sample + 1, i] for i in range(2)], 1, None, torch.device("cpu"), torch.float32
        )
        # (batched here, one request there: the VAE reduces in another order, so equal to fp32 rounding, not bits)
        torch.testing.assert_close(inputs["hidden_states"][sample, tokens:], expected[0], atol=1e-5, rtol=0)
        assert torch.equal(inputs["img_ids"][sample, tokens:], ids[0])
    assert torch.equal(inputs["img_ids"][:, :tokens], condition.pipe._prepare_latent_ids(torch.zeros(2, 1, 8, 8)))
    pred = torch.randn(inputs["hidden_states"].shape)
    assert torch.equal(condition.target_prediction(pred, inputs["target"]), pred[:, :tokens])


def test_edit_pairs_train(tiny_checkpoint, tmp_path):
    """A run on edit pairs (target + source) trains Klein with the source's tokens in the sequence."""
    from spindle.data.synthetic import make_shapes_edit_dataset
    from spindle.train.metrics import read_metrics

    pairs = make_shapes_edit_dataset(tmp_path / "pairs", num_pairs=4, size=(32, 32))
    overrides = dict(
        data__num_frames=1,
        data__resolution=[32, 32],
        model__max_text_length=32,
        train__max_steps=2,
        train__global_batch_size=2,
    )
    result = train(
        load_job_config(None, train_overrides(tiny_checkpoint("flux2_klein"), pairs, tmp_path / "run", **overrides))
    )
    records = read_metrics(result.output_dir)
    assert len(records) == 2 and all(np.isfinite(r["loss"]) for r in records)
    # the tokens the transformer saw per sample: the target's 8 x 8 and the source's as many
    assert records[0]["tokens_per_s"] / records[0]["samples_per_s"] == pytest.approx(2 * 8 * 8)
