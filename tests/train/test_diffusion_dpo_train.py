"""`train.objective: diffusion_dpo` end to end through `spindle train` on the tiny checkpoints: the step-1 loss and
gradient equal a stock diffusers computation with the same noise and timesteps, the loss starts at exactly log 2
(full and LoRA), a few steps raise the implicit accuracy, the pairs file is checked before training, a video
family runs, and the export loads in stock diffusers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY_FRAMES, TINY_SIZE, spindle_train, train_overrides

BETA = 500.0


def write_pairs(media: Path, out: Path, ext: str = "png") -> Path:
    """4 pairs from a shapes folder: pair k prefers file 2k over file 2k+1, captioned as file 2k."""
    files = sorted(media.glob(f"*.{ext}"))
    lines = []
    for k in range(4):
        chosen, rejected = files[2 * k], files[2 * k + 1]
        entry = {
            "prompt": chosen.with_suffix(".txt").read_text().strip(),
            "chosen": str(chosen),
            "rejected": str(rejected),
        }
        lines.append(json.dumps(entry))
    out.write_text("\n".join(lines) + "\n")
    return out


def dpo_run(model: Path, pairs: Path, out: Path, nproc: int = 1, **train) -> list[dict]:
    from spindle.train.metrics import read_metrics

    base = dict(
        train__objective="diffusion_dpo",
        diffusion_dpo__beta=BETA,
        data__num_frames=1,
        train__max_steps=1,
        train__micro_batch_size=2,
        train__global_batch_size=4,
    )
    spindle_train(out, nproc, train_overrides(model, pairs, out, **{**base, **train}))
    return read_metrics(out)


@pytest.fixture(scope="module")
def image_pairs(shapes_images, tmp_path_factory) -> Path:
    return write_pairs(shapes_images, tmp_path_factory.mktemp("pairs") / "pairs.jsonl")


def test_step_one_equals_a_stock_diffusers_computation(tiny_flux, image_pairs, tmp_path):
    """Full fine-tune, step 1: the reference is the starting weights, so the loss is exactly log 2; the gradient
    norm (non-zero: it is -beta/4 x the chosen-minus-rejected error gradient) equals one computed with stock
    diffusers' FluxTransformer2DModel on the pairs' latents, with the same per-pair noise and sigma."""
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from diffusers.training_utils import compute_density_for_timestep_sampling
    from diffusers.utils.torch_utils import randn_tensor

    from spindle.data.media import read_media
    from spindle.train.tasks.flow_matching import sample_generator

    metrics = dpo_run(tiny_flux, image_pairs, tmp_path / "run", train__grad_clip=0.0)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics[0]["implicit_accuracy"] == 0.0 and metrics[0]["reward_margin"] == 0.0

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    entries = [json.loads(line) for line in image_pairs.read_text().splitlines()]

    def latents(paths: list[str]) -> torch.Tensor:
        pixels = torch.stack([read_media(Path(p), 1, TINY_SIZE)[:, 0] for p in paths])
        vae = pipe.vae
        x0 = vae.encode(pixels).latent_dist.mode()
        return (x0 - vae.config.shift_factor) * vae.config.scaling_factor

    x_w, x_l = latents([e["chosen"] for e in entries]), latents([e["rejected"] for e in entries])
    with torch.no_grad():
        embeds, pooled, text_ids = pipe.encode_prompt([e["prompt"] for e in entries], None, max_sequence_length=16)
    # the trainer's per-sample draws for step 1 (its step counter 0), keyed on the pair's index: sigma (resolution-shifted), then noise
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    gens = [sample_generator(0, 0, i) for i in range(4)]  # the trainer keys step 1 as 0
    u = torch.cat([compute_density_for_timestep_sampling("uniform", 1, generator=g) for g in gens])
    mu = calculate_shift(64, 256, 4096, 0.5, 1.15)
    sigmas = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
    noise = randn_tensor(tuple(x_w.shape), generator=gens)
    pack = lambda x: FluxPipeline._pack_latents(x, 4, 4, 16, 16)  # noqa: E731
    img_ids = FluxPipeline._prepare_latent_image_ids(4, 8, 8, "cpu", torch.float32)
    s = sigmas.view(-1, 1, 1)

    def errors(model: torch.nn.Module, x0: torch.Tensor) -> torch.Tensor:
        pred = model(
            hidden_states=(1 - s) * pack(x0) + s * pack(noise),
            timestep=sigmas,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            guidance=torch.full((4,), 3.5),
            img_ids=img_ids,
            txt_ids=text_ids,
            return_dict=False,
        )[0]
        return ((pred.float() - pack(noise - x0)) ** 2).reshape(4, -1).mean(1)

    policy = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer")
    reference = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer").requires_grad_(False)
    with torch.no_grad():
        ref_w, ref_l = errors(reference, x_w), errors(reference, x_l)
    inside = -0.5 * BETA * ((errors(policy, x_w) - ref_w) - (errors(policy, x_l) - ref_l))
    loss = -F.logsigmoid(inside).mean()
    loss.backward()
    grad_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in policy.parameters() if p.grad is not None])
    )
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert grad_norm.item() > 0
    assert metrics[0]["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-5)


def test_lora_starts_at_log_two_and_exports_loadable_adapters(tiny_flux, image_pairs, tmp_path):
    """LoRA: the reference is the policy with its adapters off (zero-initialised B: the same function), so the
    step-1 loss is exactly log 2; the exported adapters load with stock diffusers' load_lora_weights, trained."""
    from diffusers import FluxPipeline

    metrics = dpo_run(
        tiny_flux, image_pairs, tmp_path / "run", train__max_steps=2, train__lora__rank=4, checkpoint__export=True
    )
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics[1]["loss"] != pytest.approx(math.log(2), rel=1e-6)  # the adapters moved the policy
    pipe = FluxPipeline.from_pretrained(tiny_flux)
    pipe.load_lora_weights(tmp_path / "run" / "export" / "lora")
    trained = {k: v for k, v in pipe.transformer.state_dict().items() if ".lora_B." in k}
    assert trained and any(v.abs().sum() > 0 for v in trained.values())  # B starts at zero: these were trained


def test_a_few_steps_raise_the_implicit_accuracy_and_the_export_loads(tiny_flux, image_pairs, tmp_path):
    """Full fine-tune on 4 pairs (every step holds all of them, fresh noise each step): the implicit accuracy
    starts at 0 (policy = reference) and the last steps prefer the chosen images with a positive margin; the
    export is a stock diffusers pipeline folder."""
    from diffusers import FluxTransformer2DModel

    metrics = dpo_run(tiny_flux, image_pairs, tmp_path / "run", train__max_steps=6, checkpoint__export=True)
    assert metrics[0]["implicit_accuracy"] == 0.0
    assert min(m["implicit_accuracy"] for m in metrics[-2:]) >= 0.75
    assert min(m["reward_margin"] for m in metrics[-2:]) > 0
    assert metrics[-1]["loss"] < math.log(2)
    exported = FluxTransformer2DModel.from_pretrained(tmp_path / "run" / "export" / "transformer")
    start = FluxTransformer2DModel.from_pretrained(tiny_flux / "transformer")
    assert any(not torch.equal(a, b) for a, b in zip(exported.parameters(), start.parameters(), strict=True))


def test_the_pairs_file_is_checked_before_training(shapes_images, tmp_path):
    """Bad lines are named file:line in one error; missing files are named; a pair with the same file twice is
    left out and counted; the refused data options name the fix."""
    from spindle.config import MediaDataConfig
    from spindle.data.media_check import DataCheckError
    from spindle.data.media_pairs import media_pairs

    a, b = sorted(shapes_images.glob("*.png"))[:2]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        (
            json.dumps({"prompt": "p", "chosen": str(a), "rejected": str(b)})
            + "\n{not json\n"
            + json.dumps({"prompt": "p", "chosen": str(a)})
            + "\n"
        ).encode()
        + b'{"prompt": "caf\xe9"}\n'  # Latin-1, not UTF-8: a line named, not a crash
    )
    data = lambda path: MediaDataConfig(path=str(path), resolution=list(TINY_SIZE), num_frames=1)  # noqa: E731
    with pytest.raises(ValueError, match="3 bad line") as e:
        media_pairs(data(bad), 0)
    assert f"{bad}:2: not valid JSON" in str(e.value) and f"{bad}:3: 'rejected' must be" in str(e.value)
    assert f"{bad}:4: not UTF-8" in str(e.value)

    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"prompt": "p", "chosen": str(a), "rejected": "gone.png"}) + "\n")
    with pytest.raises(DataCheckError, match=r"gone\.png: file does not exist"):
        media_pairs(data(missing), 0)

    same = tmp_path / "same.jsonl"
    same.write_text(
        json.dumps({"prompt": "p", "chosen": str(a), "rejected": str(b)})
        + "\n"
        + json.dumps({"prompt": "q", "chosen": a.name, "rejected": str(a)})
        + "\n"
    )
    (tmp_path / a.name).symlink_to(a)
    pairs = media_pairs(data(same), 0)
    assert len(pairs) == 1 and pairs.stats["identical_pairs"] == 1
    chosen, rejected = pairs[0]
    assert chosen["index"] == rejected["index"] == 0 and chosen["caption"] == rejected["caption"] == "p"


def test_refused_data_options_are_named_before_launch(tiny_flux, image_pairs, tmp_path):
    from spindle.testing.multiprocess import run_spindle

    cfg = tmp_path / "job.yaml"
    cfg.write_text("{}\n")
    overrides = train_overrides(
        tiny_flux,
        image_pairs,
        tmp_path / "run",
        train__objective="diffusion_dpo",
        data__num_frames=1,
        data__control_dir=tmp_path,
    )
    proc = run_spindle("train", cfg, *overrides)
    assert proc.returncode != 0
    assert "train.objective=diffusion_dpo does not take data.control_dir" in proc.stdout + proc.stderr


def test_buckets_keep_each_pair_in_its_chosen_members_bucket(tiny_flux, tmp_path):
    """data.buckets: pairs of landscape and square images; each pair is decoded at the bucket of its chosen
    member (the rejected one resized and cropped to it), a micro-batch holds pairs of one bucket, and
    `spindle train` runs on them (step 1 at log 2)."""
    from spindle.config import MediaDataConfig
    from spindle.contracts.condition import PixelGrid
    from spindle.data.media_pairs import collate_media_pairs, media_pairs
    from spindle.data.synthetic import make_shapes_image_dataset

    wide = sorted(make_shapes_image_dataset(tmp_path / "wide", num_images=4, size=(32, 64)).glob("*.png"))
    square = sorted(make_shapes_image_dataset(tmp_path / "square", num_images=4, size=(48, 48)).glob("*.png"))
    lines = [
        {"prompt": f"p{k}", "chosen": str(w), "rejected": str(q)}
        for k, (w, q) in enumerate(zip(wide, square, strict=True))
    ]
    lines += [
        {"prompt": f"q{k}", "chosen": str(q), "rejected": str(w)}
        for k, (w, q) in enumerate(zip(wide, square, strict=True))
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = MediaDataConfig(path=str(path), resolution=[48, 48], num_frames=1, buckets=True)
    pairs = media_pairs(data, 0, grid=lambda: PixelGrid(16, 16), global_batch_size=2)
    assert pairs.order is not None and pairs.stats["rows"] == 8 and pairs.stats["unbucketed"] == 0
    shapes = {k: tuple(pairs[k][0]["pixels"].shape) for k in range(8)}
    for k in range(8):
        chosen, rejected = pairs[k]
        assert chosen["pixels"].shape == rejected["pixels"].shape == shapes[k]
    assert shapes[0][-1] > shapes[0][-2] and shapes[4][-1] == shapes[4][-2]  # landscape / square buckets
    for batch in pairs.order.global_batches(0, 2):
        first, second = (collate_media_pairs([pairs[int(i)] for i in batch])["pixels"][j] for j in (0, 1))
        assert first.shape == second.shape
    metrics = dpo_run(tiny_flux, path, tmp_path / "run", data__buckets=True, data__resolution=[48, 48])
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)


def test_a_video_family_runs_a_step(tiny_wan, shapes_videos, tmp_path):
    """Wan T2V on pairs of clips: one step, loss log 2 at the start, the margin and accuracy logged."""
    pairs = write_pairs(shapes_videos, tmp_path / "pairs.jsonl", ext="mp4")
    metrics = dpo_run(tiny_wan, pairs, tmp_path / "run", data__num_frames=TINY_FRAMES)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics[0]["grad_norm"] > 0


@pytest.mark.slow
def test_fsdp2_on_two_processes_equals_one_process(tiny_flux, image_pairs, tmp_path):
    """dp_shard=2 (real gloo processes, each rank half of the pairs): the losses, grad norms and metrics of one
    process over 3 steps; both members of a pair stay on one rank and draw the same noise there."""
    # adam_eps 1e-4 (as the LM DPO layout test): Adam's first steps divide by sqrt(v) ~ |g|, which turns the
    # summation-order differences of the gradient reduction into relative weight differences of the same size
    values: dict[str, Any] = dict(train__max_steps=3, train__micro_batch_size=1, train__adam_eps=1e-4)
    one = dpo_run(tiny_flux, image_pairs, tmp_path / "one", **values)
    two = dpo_run(tiny_flux, image_pairs, tmp_path / "two", nproc=2, parallel__dp_shard=2, **values)
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm", "reward_margin"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert b["implicit_accuracy"] == a["implicit_accuracy"]


def test_an_image_to_video_family_takes_the_pairs_conditioning_image(
    tiny_wan_i2v, shapes_videos, shapes_images, tmp_path
):
    """Wan I2V: each pair's "image" conditions both members (one image, the same for the pair); one step runs
    and starts at log 2."""
    pairs = write_pairs(shapes_videos, tmp_path / "pairs.jsonl", ext="mp4")
    image = sorted(shapes_images.glob("*.png"))[0]
    entries = [{**json.loads(line), "image": str(image)} for line in pairs.read_text().splitlines()]
    pairs.write_text("\n".join(json.dumps(e) for e in entries) + "\n")

    from spindle.config import MediaDataConfig
    from spindle.data.media_pairs import collate_media_pairs, media_pairs

    data = MediaDataConfig(path=str(pairs), resolution=list(TINY_SIZE), num_frames=TINY_FRAMES)
    batch = collate_media_pairs([media_pairs(data, 0)[0], media_pairs(data, 0)[1]])
    assert batch["image"].shape == (4, 3, *TINY_SIZE) and torch.equal(batch["image"][0], batch["image"][2])
    assert batch["index"].tolist() == [0, 1, 0, 1]

    metrics = dpo_run(tiny_wan_i2v, pairs, tmp_path / "run", data__num_frames=TINY_FRAMES, model__max_text_length=512)
    assert metrics[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert metrics[0]["grad_norm"] > 0


@pytest.mark.slow
def test_sequence_parallel_equals_one_process(tiny_wan, shapes_videos, tmp_path):
    """sp=2 on Wan (Ulysses: each rank half of every sample's tokens; both ranks hold the same pairs): the losses,
    grad norms and margins of one process over 2 steps. (beta 50: the margin is beta/2 x an error difference, so
    beta scales the attention's summation-order differences up into the compared values.)"""
    pairs = write_pairs(shapes_videos, tmp_path / "pairs.jsonl", ext="mp4")
    values: dict[str, Any] = dict(
        data__num_frames=TINY_FRAMES,
        train__max_steps=2,
        train__micro_batch_size=1,
        train__adam_eps=1e-4,
        diffusion_dpo__beta=50.0,
    )
    one = dpo_run(tiny_wan, pairs, tmp_path / "one", **values)
    two = dpo_run(tiny_wan, pairs, tmp_path / "two", nproc=2, parallel__sp=2, **values)
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        # the margin is beta/2 x a difference of errors of ~1 (cancelling): its float error is absolute, ~beta x 1e-7
        assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=50 * 4e-7)


def test_precomputed_conditions_train_as_the_encoded_ones(tiny_flux, image_pairs, tmp_path, spindle_cli):
    """`spindle precompute` of a Diffusion-DPO config caches every member of every pair; the run on that cache
    (no text encoders, no VAE) logs the losses and grad norms of the run that encodes each step."""
    values: dict[str, Any] = dict(
        train__objective="diffusion_dpo", diffusion_dpo__beta=BETA, data__num_frames=1, train__max_steps=2
    )
    cfg = tmp_path / "pre.yaml"
    cfg.write_text("{}\n")
    cache = tmp_path / "cache"
    result = spindle_cli(
        "precompute", cfg, *train_overrides(tiny_flux, image_pairs, tmp_path / "x", **values), "--out", cache
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(json.loads((cache / "manifest.json").read_text())["samples"]) == 8  # 4 pairs x 2 members
    # The two runs build different processes (no encoders, no VAE in the cached one), so their matmuls may round
    # differently (a kernel's result can depend on its operands' alignment): ~1e-7 apart after step 1. As in the
    # layout tests, adam_eps 1e-4 keeps Adam's first step from dividing those by sqrt(v) ~ |g|, and beta 50: the
    # margin is beta/2 x a difference of errors of ~1 (cancelling), so its float error is absolute, ~beta x 1e-7.
    # (At beta 500 and adam_eps 1e-8, step 2's margin was 4e-5 apart on an AVX-512 CPU.)
    values = dict(train__max_steps=2, train__adam_eps=1e-4, diffusion_dpo__beta=50.0)
    plain = dpo_run(tiny_flux, image_pairs, tmp_path / "plain", **values)
    cached = dpo_run(tiny_flux, image_pairs, tmp_path / "cached", **values, data__precomputed=cache)
    for a, b in zip(plain, cached, strict=True):
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=50 * 4e-7)
    assert plain[1]["loss"] < plain[0]["loss"]  # step 2 compares trained weights
