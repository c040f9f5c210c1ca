"""Flux fine-tuning through the shared trainer: training inputs follow diffusers' Flux training
conventions, the loss falls, export round-trips into stock FluxPipeline, SP=2 equals one process."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from spindle.config import load_config
from spindle.train.metrics import read_metrics
from spindle.train.trainer import Trainer, train

SIZE = (32, 32)


def overrides(model: Path, data: Path, output_dir: Path, **train) -> list[str]:
    values = {
        "model.path": model,
        "model.max_text_length": 16,
        "data.path": data,
        "data.resolution": list(SIZE),
        "data.num_frames": 1,
        "train.output_dir": output_dir,
        "train.max_steps": 4,
        "train.global_batch_size": 4,
        "train.micro_batch_size": 2,
        "train.lr": 1e-3,
        "checkpoint.resume": "none",
    }
    values.update({k.replace("__", "."): v for k, v in train.items()})
    return [f"{k}={v}" for k, v in values.items()]


def config(model, data, output_dir, **train):
    return load_config(None, overrides(model, data, output_dir, **train))


@pytest.fixture(scope="module")
def condition(tiny_flux):
    from spindle.models.flux.condition import FluxConditionModel

    return FluxConditionModel.from_pretrained(tiny_flux, max_text_length=16)


def test_training_inputs_follow_diffusers_flux_conventions(condition, tiny_flux):
    """What examples/dreambooth/train_dreambooth_flux.py computes, step by step, with the same noise."""
    from diffusers import FluxPipeline
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.train.tasks.flow_matching import sample_generator

    pipe = condition.pipe
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 3, 1, *SIZE, generator=g) * 2 - 1
    batch = {"pixels": pixels, "caption": ["a red circle", "a blue square on the left"], "index": [3, 5]}
    cond = condition.encode(batch)

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

    from spindle.models.base import load_transformer

    params = inspect.signature(load_transformer(tiny_flux).forward).parameters
    assert set(inputs) - {"target", "sigmas"} <= set(params)


def test_static_shift_from_config_replaces_resolution_shift(condition):
    from spindle.models.base import TimestepSampling
    from spindle.train.tasks.flow_matching import sample_generator

    cond = {
        "latents": torch.zeros(1, 4, 16, 16),
        "prompt_embeds": torch.zeros(1, 16, 32),
        "pooled_prompt_embeds": torch.zeros(1, 32),
    }
    saved = condition.timestep_sampling
    try:
        condition.timestep_sampling = TimestepSampling(shift=3.0)
        static = condition.training_inputs(cond, [sample_generator(0, 0, 0)])["sigmas"]
        condition.timestep_sampling = TimestepSampling(shift=1.0)
        dynamic = condition.training_inputs(cond, [sample_generator(0, 0, 0)])["sigmas"]
    finally:
        condition.timestep_sampling = saved
    u = torch.rand(1, generator=sample_generator(0, 0, 0))
    torch.testing.assert_close(static, 3 * u / (1 + 2 * u))
    assert not torch.allclose(static, dynamic)


def test_video_pixels_are_rejected(condition):
    with pytest.raises(ValueError, match=r"Flux generates images: pixels must be \[B, C, 1, H, W\]"):
        condition.encode({"pixels": torch.zeros(1, 3, 5, 32, 32), "caption": ["x"], "index": [0]})
    with pytest.raises(ValueError, match="divisible by 4; got 30x32"):
        condition.encode({"pixels": torch.zeros(1, 3, 1, 30, 32), "caption": ["x"], "index": [0]})


def test_overfit_loss_falls(tiny_flux, shapes_images, tmp_path):
    cfg = config(
        tiny_flux,
        shapes_images,
        tmp_path / "run",
        train__max_steps=30,
        train__lr=2e-3,
        train__micro_batch_size=4,
        checkpoint__export=False,
    )
    train(cfg)
    records = read_metrics(cfg.train.output_dir)
    losses = [m["loss"] for m in records]
    assert len(losses) == 30
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < 0.6 * first, f"loss did not fall enough: {first:.4f} -> {last:.4f}"
    # 32x32 px -> 16x16 latents -> 8x8 packed tokens per image
    assert records[0]["tokens_per_s"] / records[0]["samples_per_s"] == pytest.approx(64)


def test_export_round_trip_in_stock_flux_pipeline(tiny_flux, shapes_images, tmp_path):
    import numpy as np
    from diffusers import FluxPipeline, FluxTransformer2DModel

    trainer = Trainer(config(tiny_flux, shapes_images, tmp_path / "run", train__max_steps=3))
    result = trainer.run()
    trained = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    trained = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in trained.items()}
    exported = load_file(result.export_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    original = load_file(tiny_flux / "transformer" / "diffusion_pytorch_model.safetensors")
    assert any(not torch.equal(original[k], exported[k]) for k in original), "training changed nothing"
    config_json = json.loads((result.export_dir / "transformer" / "config.json").read_text())
    assert set(config_json) == set(json.loads((tiny_flux / "transformer" / "config.json").read_text()))

    model = FluxTransformer2DModel.from_pretrained(result.export_dir / "transformer")
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    pipe = FluxPipeline.from_pretrained(result.export_dir)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(prompt="a red circle on the left", height=32, width=32, num_inference_steps=2, max_sequence_length=16)
    ref = pipe(**kw, output_type="np", generator=torch.Generator().manual_seed(0)).images
    assert ref.shape == (1, 32, 32, 3)
    from spindle import DiffusionGenerator

    ours = DiffusionGenerator.from_pretrained(result.export_dir).generate(**kw, seed=0).frames
    np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ multi-process (torchrun, gloo)


def run_cli(model: Path, data: Path, out: Path, nproc: int, **train_kw) -> None:
    cfg = out.parent / f"{out.name}.yaml"
    cfg.write_text(yaml.safe_dump({}))
    base = dict(train__max_steps=3, train__micro_batch_size=1, checkpoint__export=True, data__shuffle=True)
    args = overrides(model, data, out, **{**base, **train_kw})
    proc = subprocess.run(
        [sys.executable, "-m", "spindle", "train", str(cfg), *args, "--nproc", str(nproc)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_sequence_parallel_training_equals_one_process(tiny_flux, shapes_images, tmp_path):
    """SP=2 through FluxTransformer2DModel's own `_cp_plan` (image tokens, text tokens and both id
    tensors split over 2 ranks) trains exactly like one process: losses, grad norms, weights."""
    run_cli(tiny_flux, shapes_images, tmp_path / "single", nproc=1)
    run_cli(tiny_flux, shapes_images, tmp_path / "sp2", nproc=2, parallel__sp=2, parallel__dp_shard=1)
    a, b = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "sp2")
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-5), key
    wa = load_file(tmp_path / "single" / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    wb = load_file(tmp_path / "sp2" / "export" / "transformer" / "diffusion_pytorch_model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-5, msg=k)


def test_demo_family_flux(tmp_path):
    """`spindle demo --family flux`: tiny model -> png dataset -> fine-tune -> export -> png sample."""
    import numpy as np
    from PIL import Image

    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "spindle", "demo", "--family", "flux", "--out", str(out), "--steps", "30"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FluxPipeline.from_pretrained loads it" in proc.stdout
    assert len(list((out / "data").glob("*.png"))) == 16
    losses = [m["loss"] for m in read_metrics(out / "run")]
    assert statistics.mean(losses[-5:]) < 0.6 * statistics.mean(losses[:5])
    sample = np.asarray(Image.open(out / "sample.png"))
    assert sample.shape == (32, 32, 3)
    assert json.loads((out / "run" / "export" / "model_index.json").read_text())["_class_name"] == "FluxPipeline"
