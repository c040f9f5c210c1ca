"""FLUX.1 Kontext training on edit pairs: the training inputs are what stock FluxKontextPipeline hands its
transformer for the same source image (reference latents, ids, units), a LoRA edit fine-tune on the
target + control folder layout exports what stock diffusers loads and applies (with validation samples
from their source images), and a resumed run equals the straight one. (Overfit, full export, precomputed
conditions, SP = one process: tests/conformance for flux_kontext.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from spindle.api import load_generator, load_job_config, train
from spindle.data.datasets import build_dataset, collate
from spindle.data.synthetic import make_shapes_edit_dataset
from spindle.train.metrics import read_metrics
from tests.conftest import TINY_TEXT, first_transformer_inputs, train_interrupted, train_overrides

SIZE = (32, 32)
LORA = "{rank: 4, alpha: 8}"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """4 edit pairs in the musubi-tuner layout: -> (targets folder, controls folder)."""
    root = tmp_path_factory.mktemp("pairs")
    return make_shapes_edit_dataset(root, num_pairs=4, size=SIZE, layout="folders"), root / "controls"


def overrides(tiny, pairs, out, **train):
    targets, controls = pairs
    base = dict(data__num_frames=1, data__resolution=list(SIZE), data__control_dir=str(controls))
    return train_overrides(tiny, targets, out, **base, train__global_batch_size=2, **train)


def stock_transformer_inputs(root, image, prompt: str) -> dict:
    """What stock FluxKontextPipeline hands its transformer at its first step."""
    from diffusers import FluxKontextPipeline

    return first_transformer_inputs(
        FluxKontextPipeline.from_pretrained(root), image=image, prompt=prompt, height=SIZE[0], width=SIZE[1],
        max_area=SIZE[0] * SIZE[1], _auto_resize=False, num_inference_steps=1, max_sequence_length=TINY_TEXT,
        output_type="latent",
    )  # fmt: skip


def test_training_inputs_follow_the_pipeline(tiny_flux_kontext, pairs):
    from spindle.models.flux_kontext.condition import FluxKontextConditionModel

    targets, controls = pairs
    condition = FluxKontextConditionModel.from_pretrained(tiny_flux_kontext, max_text_length=TINY_TEXT)
    batch = collate([build_dataset(targets, SIZE, 1, control_dir=controls).load(i) for i in (0, 1)])
    conditions = condition.encode(batch)
    inputs = condition.training_inputs(conditions, [torch.Generator().manual_seed(i) for i in range(2)])
    tokens = (SIZE[0] // 4) * (SIZE[1] // 4)  # VAE x2, 2x2 packing
    assert inputs["hidden_states"].shape[1] == 2 * tokens and inputs["target"].shape[1] == tokens
    for i in range(2):
        source = Image.open(controls / f"pair_{i:03d}.png").convert("RGB")
        stock = stock_transformer_inputs(tiny_flux_kontext, source, batch["caption"][i])
        # the reference tokens: the source's VAE latents packed after the noisy latents'
        torch.testing.assert_close(
            inputs["hidden_states"][i, tokens:], stock["hidden_states"][0, tokens:], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(inputs["img_ids"], stock["img_ids"], atol=0, rtol=0)  # reference ids offset to 1
        torch.testing.assert_close(inputs["encoder_hidden_states"][i], stock["encoder_hidden_states"][0])
        torch.testing.assert_close(inputs["pooled_projections"][i], stock["pooled_projections"][0])
    assert stock["guidance"].shape == (1,) and inputs["guidance"].shape == (2,)  # embedded guidance per sample
    sigmas = inputs["sigmas"]
    assert torch.equal(inputs["timestep"], sigmas) and bool(((sigmas > 0) & (sigmas < 1)).all())  # x1000 inside
    # the loss reads the prediction of the target's tokens only
    pred = torch.randn(2, 2 * tokens, inputs["target"].shape[2])
    assert torch.equal(condition.target_prediction(pred, inputs["target"]), pred[:, :tokens])


def test_a_source_count_kontext_cannot_take_is_refused(tiny_flux_kontext):
    from spindle.models.flux_kontext.condition import FluxKontextConditionModel

    condition = FluxKontextConditionModel.from_pretrained(tiny_flux_kontext, max_text_length=TINY_TEXT)
    batch = {"pixels": torch.zeros(1, 3, 1, *SIZE), "caption": ["x"], "images": torch.zeros(1, 2, 3, *SIZE)}
    with pytest.raises(ValueError, match=r"edits one source image per sample; .*\(1, 2, 3, 32, 32\).*single \"image\""):
        condition.encode(batch)


def test_lora_edit_finetune_exports_what_stock_diffusers_applies(tiny_flux_kontext, pairs, tmp_path):
    from diffusers import FluxKontextPipeline

    controls = pairs[1]
    source = controls / "pair_002.png"
    validation = dict(
        train__validation__every_steps=2, train__validation__prompts='["the red circle to blue"]',
        train__validation__images=f'["{source}"]', train__validation__num_inference_steps=2,
        train__validation__options='{max_area: 1024, auto_resize: false}',
    )  # fmt: skip
    cfg = load_job_config(
        None, overrides(tiny_flux_kontext, pairs, tmp_path / "run", train__max_steps=2, train__lora=LORA, **validation)
    )
    result = train(cfg)
    # the validation sample, rendered from its source image, at the training size
    sample = result.output_dir / "samples" / "step-000002" / "00.png"
    assert np.asarray(Image.open(sample)).shape == (*SIZE, 3)
    record = json.loads((sample.parent / "prompts.json").read_text())
    assert record["images"] == [str(source)] and record["max_area"] == 1024

    lora_dir = result.export_dir / "lora"
    request = dict(
        prompt="the green square to red", height=32, width=32, max_area=1024, num_inference_steps=2,
        guidance_scale=2.5, max_sequence_length=TINY_TEXT,
    )  # fmt: skip
    image = Image.open(source).convert("RGB")
    pipe = FluxKontextPipeline.from_pretrained(tiny_flux_kontext)
    pipe.load_lora_weights(lora_dir)
    stock = pipe(
        **request, image=image, _auto_resize=False, output_type="np", generator=torch.Generator().manual_seed(0)
    )
    gen = load_generator(tiny_flux_kontext, device="cpu", lora=str(lora_dir))
    ours = gen.generate(**request, image=image, auto_resize=False, seed=0).frames
    assert np.abs(stock.images - ours).max() <= 1e-5
    base = load_generator(tiny_flux_kontext, device="cpu").generate(**request, image=image, auto_resize=False, seed=0)
    assert np.abs(base.frames - ours).max() > 1e-4, "the LoRA changed nothing"

    # the original (BFL / kohya) layout, as flux writes it: FluxKontextPipeline reads LoRAs with FluxPipeline's
    # reader, which reads that layout back exactly (at FLUX.1's real projection sizes, which the reader
    # hard-codes: tests/train/test_lora.py::test_flux_original_layout_round_trips_through_diffusers)
    from diffusers import FluxPipeline

    from spindle.models.flux.lora import to_original

    adapters = load_file(lora_dir / "pytorch_lora_weights.safetensors")
    original = load_file(lora_dir / "original_layout_lora.safetensors")
    expected = to_original({k.removeprefix("transformer."): v for k, v in adapters.items()})
    assert original.keys() == expected.keys() and all(torch.equal(original[k], expected[k]) for k in expected)
    assert any(k.startswith("lora_unet_double_blocks_0_img_attn_qkv.") for k in original)
    assert FluxKontextPipeline.lora_state_dict.__func__ is FluxPipeline.lora_state_dict.__func__


def test_resumed_edit_run_equals_the_straight_one(tiny_flux_kontext, pairs, tmp_path, monkeypatch):
    common = dict(train__max_steps=4, checkpoint__every_steps=2, checkpoint__export=False, train__lora=LORA)

    def make(out, **kw):
        return load_job_config(None, overrides(tiny_flux_kontext, pairs, out, **kw))

    train(make(tmp_path / "straight", **common))
    train_interrupted(make, tmp_path / "resumed", monkeypatch, 3, **common)
    train(make(tmp_path / "resumed", checkpoint__resume="auto", **common))
    straight = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "straight")]
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / "resumed")] == straight


def test_validation_options_are_checked_before_launch(tiny_flux_kontext, pairs, tmp_path):
    controls = pairs[1]
    bad = dict(
        train__validation__every_steps=2, train__validation__prompts='["x"]',
        train__validation__images=f'["{controls / "pair_000.png"}"]', train__validation__options="{max_areaa: 3}",
    )  # fmt: skip
    cfg = load_job_config(None, overrides(tiny_flux_kontext, pairs, tmp_path / "run", **bad))
    with pytest.raises(ValueError, match=r"train.validation.options: max_areaa is not an option of flux_kontext"):
        train(cfg)


def test_precomputed_edit_pairs_train_like_raw_ones(tiny_flux_kontext, pairs, tmp_path):
    """`spindle precompute` of the control-folder layout caches the sources' latents; training on the
    cache equals training on the media, and a changed source makes the cache stale."""
    import os

    from spindle.commands.precompute import precompute
    from spindle.data.precomputed import StaleCacheError

    common = dict(train__max_steps=2, checkpoint__export=False)
    precompute(load_job_config(None, overrides(tiny_flux_kontext, pairs, tmp_path / "unused")), tmp_path / "cache")
    assert "image_latents" in load_file(tmp_path / "cache" / "samples" / "00000000.safetensors")
    train(load_job_config(None, overrides(tiny_flux_kontext, pairs, tmp_path / "raw", **common)))

    def from_cache(out):
        return load_job_config(
            None, overrides(tiny_flux_kontext, pairs, out, data__precomputed=str(tmp_path / "cache"), **common)
        )

    train(from_cache(tmp_path / "cached"))
    for key in ("loss", "grad_norm"):
        raw = [m[key] for m in read_metrics(tmp_path / "raw")]
        assert [m[key] for m in read_metrics(tmp_path / "cached")] == pytest.approx(raw, rel=1e-6), key
    source = pairs[1] / "pair_001.png"
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new source file, same name
    try:
        with pytest.raises(StaleCacheError, match=r"1 samples changed since the cache was made"):
            train(from_cache(tmp_path / "stale"))
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
