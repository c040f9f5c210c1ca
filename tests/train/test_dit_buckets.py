"""Training on bucketed, mixed-source data (issue 31): Wan and Flux train on clips and stills at several
aspect ratios and lengths, every sample's latents have its bucket's shape, the same global batch split
2x1, 1x2 and over 2 ranks sees the same samples per step (equal losses), and a run killed with
SIGKILL resumes exactly. The data side (buckets, order, sources, captions, index) is
tests/data/test_buckets.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from spindle.api import load_job_config, train
from spindle.data.dit_data import build_dit_data
from spindle.train.metrics import read_metrics
from spindle.train.tasks.flow_matching import FlowMatchingTask
from tests.conftest import spindle_train, spindle_train_killed, train_overrides


def mixed_overrides(model: Path, mixed, out: Path, **train_kw) -> list[str]:
    sources = [
        {"path": str(mixed.videos), "kind": "video", "name": "clips"},
        {"path": str(mixed.images), "kind": "image", "weight": 0.5, "name": "stills"},
    ]
    base = dict(
        data__path="null",
        data__sources=json.dumps(sources),
        data__buckets=True,
        data__resolution=[32, 48],
        data__caption_dropout=0.25,
        data__caption_prefix="sks",
        train__max_steps=6,
        train__global_batch_size=2,
        train__micro_batch_size=1,
        checkpoint__every_steps=3,
        checkpoint__export=False,
    )
    return train_overrides(model, mixed.videos, out, **{**base, **train_kw})


def record_inputs(monkeypatch) -> list[tuple[list[int], tuple[int, ...]]]:
    """(sample indices, the transformer's hidden_states shape) of every forward of the run."""
    seen: list[tuple[list[int], tuple[int, ...]]] = []
    original = FlowMatchingTask.forward

    def forward(self, model, batch, step):
        def hook(module, args, kwargs):
            seen.append((batch["index"].tolist(), tuple(kwargs["hidden_states"].shape)))

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            return original(self, model, batch, step)
        finally:
            handle.remove()

    monkeypatch.setattr(FlowMatchingTask, "forward", forward)
    return seen


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out)]


@pytest.fixture(scope="module")
def wan_reference(tiny_wan, mixed_media, tmp_path_factory) -> Path:
    """The 6-step bucketed Wan run, one process, micro-batches of 1 (2 accumulation steps)."""
    out = tmp_path_factory.mktemp("buckets") / "reference"
    train(load_job_config(None, mixed_overrides(tiny_wan, mixed_media, out)))
    return out


def test_wan_trains_on_buckets_with_each_latent_at_its_bucket_shape(
    wan_reference, tiny_wan, mixed_media, tmp_path, monkeypatch
):
    seen = record_inputs(monkeypatch)
    out = tmp_path / "micro2"
    cfg = load_job_config(None, mixed_overrides(tiny_wan, mixed_media, out, train__micro_batch_size=2))
    train(cfg)
    # 1x2 (one micro-batch of 2) sees what 2x1 (two of 1) saw: the same losses step by step
    assert losses(out) == pytest.approx(losses(wan_reference), rel=1e-5)
    plan = build_dit_data(cfg.data, lambda: _grid(tiny_wan), 0, 2).dataset.plan
    shapes = set()
    for indices, hidden in seen:
        (frames, height, width), *others = {plan.shape(i) for i in indices}
        assert not others  # one bucket per micro-batch
        # [B, C, F', H', W'] latents: the tiny VAE's factors (time 4, space 8)
        assert (hidden[0], *hidden[2:]) == (len(indices), (frames - 1) // 4 + 1, height // 8, width // 8)
        shapes.add((frames, height, width))
    assert len(shapes) >= 3
    # the run summary's histogram and per-source counts; per-step source counts in the metrics
    start = json.loads((out / "summary.json").read_text())["start"]["data"]
    assert start["sources"] == {"clips": {"samples": 4, "per_epoch": 4}, "stills": {"samples": 4, "per_epoch": 2}}
    assert sum(b["samples"] for b in start["buckets"].values()) == 8 and start["rows"] == 6
    for m in read_metrics(out):
        assert m["source/clips"] + m["source/stills"] == 2


def _grid(root: Path):
    from spindle.models.wan.condition import WanConditionModel

    return WanConditionModel.pixel_grid(root)


def test_flux_trains_on_image_buckets(tiny_flux, mixed_media, tmp_path, monkeypatch):
    seen = record_inputs(monkeypatch)
    out = tmp_path / "flux"
    sources = [{"path": str(mixed_media.images), "kind": "image"}]
    overrides = train_overrides(
        tiny_flux,
        mixed_media.videos,
        out,
        data__path="null",
        data__sources=json.dumps(sources),
        data__buckets=True,
        data__num_frames=1,
        train__max_steps=4,
        train__global_batch_size=1,
        train__micro_batch_size=1,
        checkpoint__export=False,
    )
    cfg = load_job_config(None, overrides)
    train(cfg)
    from spindle.models.flux.condition import FluxConditionModel

    plan = build_dit_data(cfg.data, lambda: FluxConditionModel.pixel_grid(tiny_flux), 0, 1).dataset.plan
    tokens = set()
    for (index,), hidden in seen:  # packed 2x2 tokens of the VAE's x2 latents: (h / 4) x (w / 4)
        _, height, width = plan.shape(index)
        assert hidden[1] == (height // 4) * (width // 4)
        tokens.add(hidden[1])
    assert len(tokens) >= 2 and len(read_metrics(out)) == 4


def test_precomputed_buckets_and_captions_train_like_raw_media(tiny_wan, mixed_media, tmp_path):
    """`spindle precompute` caches every sample at its bucket's shape, with each of its captions (the prefix
    put before) and the empty caption once; training on the cache, caption dropout and the per-epoch
    caption draw included, equals training on the media."""
    from spindle.commands.precompute import precompute

    common = dict(train__max_steps=4, train__global_batch_size=1)  # 4 epochs of the 3 + 2 weighted stills
    raw = load_job_config(None, mixed_overrides(tiny_wan, mixed_media, tmp_path / "raw", **common))
    precompute(raw, tmp_path / "cache")
    files = sorted((tmp_path / "cache" / "samples").iterdir())
    shapes = {load_file(f)["latents"].shape[1:] for f in files}
    assert shapes == {(3, 4, 6), (3, 6, 4), (2, 4, 6), (1, 4, 6), (1, 6, 4), (1, 8, 4), (1, 2, 2)}  # all 8 buckets
    variants = [k for f in files for k in load_file(f) if "@caption" in k]
    assert variants and all(k.endswith("@caption1") for k in variants)  # each still's second caption
    built = build_dit_data(raw.data, lambda: _grid(tiny_wan), 0, 1)
    steps = [int(i) for i in built.order.global_batches(0, 1).reshape(-1)[:4]]
    picks = [built.dataset.captions.pick(len(built.dataset.samples[i].captions) or 1, 0, i) for i in steps]
    assert None in picks and 1 in picks  # the 4 steps include a dropped caption and a still's second caption
    train(raw)
    cached = mixed_overrides(tiny_wan, mixed_media, tmp_path / "cached", data__precomputed=tmp_path / "cache", **common)
    train(load_job_config(None, cached))
    assert losses(tmp_path / "cached") == pytest.approx(losses(tmp_path / "raw"), rel=1e-6)


@pytest.mark.parametrize("family", ["wan_i2v", "qwenimage"])
def test_the_other_dit_families_train_on_buckets(family, tiny_checkpoint, mixed_media, tmp_path, monkeypatch):
    """Wan and Flux are trained above; Wan I2V (each bucket's first frame as the conditioning image) and
    Qwen-Image take bucketed batches too."""
    from spindle.registry import get_family
    from spindle.testing.conformance import text_tokens

    seen = record_inputs(monkeypatch)
    fam = get_family(family)
    root = tiny_checkpoint(family)
    video = fam.condition_model_cls().pixel_grid(root).frame_multiple is not None
    sources = [{"path": str(mixed_media.videos), "kind": "video"}] if video else []
    sources.append({"path": str(mixed_media.images), "kind": "image"})
    overrides = mixed_overrides(
        root,
        mixed_media,
        tmp_path / family,
        data__sources=json.dumps(sources),
        data__num_frames=9 if video else 1,
        model__max_text_length=text_tokens(fam),
        train__max_steps=3,
        train__global_batch_size=1,
        checkpoint__every_steps=0,
    )
    train(load_job_config(None, overrides))
    assert len(read_metrics(tmp_path / family)) == 3
    assert len({hidden[1:] for _, hidden in seen}) >= 2  # batches of different buckets' shapes


@pytest.mark.slow
def test_two_ranks_see_the_same_samples_and_a_killed_run_resumes_exactly(
    wan_reference, tiny_wan, mixed_media, tmp_path
):
    # 2 data-parallel ranks (gloo, real processes) x micro-batches of 1 = the global batch of 2
    ranks = tmp_path / "ranks"
    spindle_train(ranks, 2, mixed_overrides(tiny_wan, mixed_media, ranks))
    assert losses(ranks) == pytest.approx(losses(wan_reference), rel=1e-5)

    killed = tmp_path / "killed"
    # steps 1-4 logged; the checkpoint of step 3 is the last
    spindle_train_killed(killed, mixed_overrides(tiny_wan, mixed_media, killed), at_step=5)
    train(load_job_config(None, mixed_overrides(tiny_wan, mixed_media, killed, checkpoint__resume="auto")))
    assert [m["step"] for m in read_metrics(killed)] == list(range(1, 7))
    assert losses(killed) == losses(wan_reference)  # exact: CPU fp32, the same samples in the same steps


@pytest.mark.slow
def test_sequence_parallel_lora_with_validation_equals_one_process(tiny_wan, mixed_media, tmp_path):
    """SP=2 (2 processes) x LoRA x validation samples on bucketed data equals one process. With SP every
    bucket's tokens must split over the ranks: the 16x16 still (one token) joins a full bucket (upscale)."""
    options = dict(
        data__buckets=json.dumps({"upscale": True}),
        train__lora=json.dumps({"rank": 4}),
        train__max_steps=4,
        train__validation=json.dumps({"every_steps": 2, "prompts": ["a clip"], "num_inference_steps": 2}),
    )
    one = tmp_path / "one"
    train(load_job_config(None, mixed_overrides(tiny_wan, mixed_media, one, **options)))
    sp = tmp_path / "sp"
    spindle_train(sp, 2, mixed_overrides(tiny_wan, mixed_media, sp, parallel__sp=2, **options))
    assert losses(sp) == pytest.approx(losses(one), rel=1e-5)
    assert [m["grad_norm"] for m in read_metrics(sp)] == pytest.approx(
        [m["grad_norm"] for m in read_metrics(one)], rel=1e-5
    )
    assert sorted(p.name for p in (sp / "samples").iterdir()) == sorted(p.name for p in (one / "samples").iterdir())
