"""DiT data as users have it (issue 31): aspect-ratio and frame-count buckets, mixed sources with
repeats and weights, caption dropout / several captions / a prefix, and lazily indexed JSONL shards.

The dataset (`mixed_media`, tests/conftest.py) holds clips and stills at several aspect ratios and
lengths; the training side (Wan and Flux runs, layouts, kill -9) is tests/train/test_dit_buckets.py.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from spindle.config import ConfigError, DiTJobConfig, MediaDataConfig, validate_config
from spindle.contracts.condition import PixelGrid
from spindle.contracts.family import DiTFamily
from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import MediaError, build_dataset, open_manifest, read_manifest
from spindle.data.dit_data import build_dit_data
from spindle.data.index import ShardedManifest
from spindle.data.loader import ResumableLoader
from spindle.data.media_check import DataCheckError
from spindle.registry import all_families, get_family
from tests.conftest import MIXED_IMAGES, MIXED_VIDEOS

WAN_GRID = PixelGrid(16, 16, frame_multiple=4)  # the tiny Wan checkpoint's (VAE x8 x patch 2)
BUCKETS = {
    "wide_a": (9, 32, 48),
    "wide_b": (9, 32, 48),  # 12 frames: the longest 4k+1 count it fills
    "tall_a": (9, 48, 32),
    "short": (5, 32, 48),  # 6 frames
    "wide": (1, 32, 48),
    "tall": (1, 48, 32),
    "small": (1, 16, 16),  # 16x24: never enlarged, its own size down to the grid
    "tall2": (1, 64, 32),
}


def sources(mixed, videos: dict | None = None, images: dict | None = None) -> list[dict]:
    return [
        {"path": str(mixed.videos), "kind": "video", **(videos or {})},
        {"path": str(mixed.images), "kind": "image", **(images or {})},
    ]


def built_cfg(mixed, **data) -> MediaDataConfig:
    return MediaDataConfig(
        **{"sources": sources(mixed), "buckets": True, "resolution": (32, 48), "num_frames": 9, **data}
    )


def mixed_data(mixed, grid: PixelGrid = WAN_GRID, global_batch_size: int = 2, **data):
    return build_dit_data(built_cfg(mixed, **data), lambda: grid, seed=0, global_batch_size=global_batch_size)


def shapes_by_name(built) -> dict[str, tuple[int, int, int]]:
    return {s.path.stem: built.dataset.plan.shape(i) for i, s in enumerate(built.dataset.samples)}


# ---------------------------------------------------------------- buckets


def test_each_sample_is_decoded_at_its_bucket_and_small_sources_are_not_enlarged(mixed_media):
    built = mixed_data(mixed_media)
    assert shapes_by_name(built) == BUCKETS
    for i in range(len(built.dataset)):
        frames, height, width = built.dataset.plan.shape(i)
        assert built.dataset[i]["pixels"].shape == (3, frames, height, width)
    # the start-up histogram: samples per bucket and the repeats padding each one's last global batch of 2
    report = built.stats["buckets"]
    assert report["9x32x48"] == {"samples": 2, "padded": 0, "dropped": 0}
    assert report["1x16x16"] == {"samples": 1, "padded": 1, "dropped": 0}
    assert sum(r["samples"] for r in report.values()) == 8 and built.stats["unbucketed"] == 0
    dropped = mixed_data(mixed_media, buckets={"remainder": "drop"}).stats["buckets"]
    assert dropped["9x32x48"]["dropped"] == 0 and dropped["1x16x16"] == {"samples": 1, "padded": 0, "dropped": 1}
    # sequence parallelism splits each sample's tokens: the one-token 16x16 bucket cannot be split in 2
    with pytest.raises(ValueError, match=r"over 2 ranks, but bucket\(s\) 1x16x16 \(1 tokens\) do not divide"):
        build_dit_data(built_cfg(mixed_media), lambda: WAN_GRID, seed=0, global_batch_size=2, sequence_split=2)
    # asked to: the small still is enlarged into the bucket of its aspect
    upscaled = shapes_by_name(mixed_data(mixed_media, buckets={"upscale": True}))
    assert upscaled["small"] == (1, 32, 48)


def test_frame_buckets_follow_the_family_rule(mixed_media):
    built = mixed_data(mixed_media, buckets={"frames": [5, 9]})  # no 1-frame bucket: the stills fit none
    assert built.stats["unbucketed"] == 4
    assert {s for s in built.dataset.plan.shapes} == {(9, 32, 48), (9, 48, 32), (5, 32, 48)}
    with pytest.raises(ValueError, match=r"data.buckets.frames: \[6\] not taken by this model; counts must be 4k\+1"):
        mixed_data(mixed_media, buckets={"frames": [5, 6]})
    # an image family: every sample one frame, a clip its first frame
    image_grid = mixed_data(mixed_media, grid=PixelGrid(4, 4), resolution=(32, 32))
    assert {f for f, _, _ in image_grid.dataset.plan.shapes} == {1}
    assert shapes_by_name(image_grid)["small"] == (1, 16, 24)  # a finer grid keeps its own size


def test_latents_have_their_bucket_shape(mixed_media, tiny_condition):
    condition = tiny_condition("wan")
    built = mixed_data(mixed_media)
    loader = ResumableLoader(built.dataset, 2, 0, 1, seed=0, global_batch_size=2, order=built.order)
    seen = set()
    for _ in range(loader.steps_per_epoch):
        batch = next(loader)
        frames, height, width = built.dataset.plan.shape(int(batch["index"][0]))
        latents = condition.encode_pixels(batch["pixels"])
        t, s = condition.scale_factor_temporal, condition.scale_factor_spatial
        assert latents.shape[2:] == ((frames - 1) // t + 1, height // s, width // s)
        seen.add((frames, height, width))
    assert seen == set(BUCKETS.values())


DIT_FAMILIES = [f.name for f in all_families() if isinstance(f, DiTFamily)]


@pytest.mark.parametrize("family", DIT_FAMILIES)
def test_every_dit_family_encodes_the_shapes_of_its_pixel_grid(family, tiny_checkpoint):
    """A bucket on the family's grid (read from the checkpoint) is a shape its condition model encodes; half
    a grid step off is refused by it: the grid is what the VAE and the patching need, not a guess."""
    from spindle.data.datasets import collate
    from spindle.testing.conformance import text_tokens

    cls = get_family(family).condition_model_cls()
    root = tiny_checkpoint(family)
    condition = cls.from_pretrained(
        root, torch.device("cpu"), torch.float32, max_text_length=text_tokens(get_family(family))
    )
    grid = cls.pixel_grid(root)
    frames = grid.frame_counts(9)[-1]
    sources = get_family(family).options.images[0]  # an edit family's required source images, sized as the target

    def item(height: int, width: int) -> dict:
        out = {"pixels": torch.zeros(3, frames, height, width), "caption": "a cat", "index": 0}
        return {**out, "images": torch.zeros(sources, 3, height, width)} if sources else out

    sample = item(2 * grid.height, 3 * grid.width)
    latents = condition.encode(collate([sample]))["latents"]
    assert latents.shape[-1] * 2 == latents.shape[-2] * 3  # the bucket's aspect survives the encoding
    off = item(2 * grid.height + grid.height // 2, 3 * grid.width)
    with pytest.raises(ValueError, match="divisible by"):
        condition.encode(collate([off]))


class Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def steps_seen(order, n: int, micro: int, ranks: int, steps: int, state: dict | None = None) -> list[list[int]]:
    """The sorted sample indices of each optimizer step (global batch 4), over every rank and micro-batch."""
    loaders = [
        ResumableLoader(Indices(n), micro, r, ranks, seed=0, global_batch_size=4, order=order, collate_fn=list)
        for r in range(ranks)
    ]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    accum = 4 // (micro * ranks)
    return [sorted(i for loader in loaders for _ in range(accum) for i in next(loader)) for _ in range(steps)]


def test_every_split_and_resume_sees_the_same_samples_per_step(mixed_media):
    built = mixed_data(mixed_media, global_batch_size=4, sources=sources(mixed_media, {"repeats": 3}))
    n = len(built.dataset)
    one = steps_seen(built.order, n, micro=4, ranks=1, steps=12)  # over several epochs
    assert steps_seen(built.order, n, micro=1, ranks=1, steps=12) == one  # 4 accumulation steps
    assert steps_seen(built.order, n, micro=2, ranks=2, steps=12) == one
    assert steps_seen(built.order, n, micro=1, ranks=4, steps=12) == one
    ids = built.dataset.plan.ids
    assert all(len({int(ids[i]) for i in step}) == 1 for step in one)  # a global batch is one bucket
    assert len({tuple(s) for s in one}) > 6  # shuffled: not the same batch over and over
    # resumed after step 5 (position in micro-batches of 1 process x 2), at another split
    resumed = steps_seen(built.order, n, micro=1, ranks=2, steps=7, state={"epoch": 0, "position": 5 * 2})
    epoch0 = len(built.order.global_batches(0, 4))
    assert epoch0 > 5 and resumed[: epoch0 - 5] == one[5:epoch0]


# ---------------------------------------------------------------- sources


def test_sources_repeat_and_weigh_their_samples(mixed_media):
    built = mixed_data(mixed_media, sources=sources(mixed_media, {"repeats": 2}, {"weight": 0.5, "name": "stills"}))
    mix = built.mix
    assert built.stats["sources"] == {
        "videos": {"samples": 4, "per_epoch": 8},
        "stills": {"samples": 4, "per_epoch": 2},
    }
    assert built.stats["rows"] == 10
    halves = set()
    for epoch in range(6):
        entries = mix.epoch_entries(epoch)
        assert mix.counts(entries) == {"videos": 8, "stills": 2}
        videos = entries[mix.ids[entries] == 0]
        assert sorted(np.bincount(videos).tolist()[:4]) == [2, 2, 2, 2]  # each clip exactly twice
        halves.add(tuple(sorted(entries[mix.ids[entries] == 1].tolist())))
    assert len(halves) > 1  # the weighted half is drawn anew each epoch


def test_source_kinds(mixed_media, tmp_path):
    with pytest.raises(MediaError, match=r"4 line\(s\) of .*images.jsonl are not video files.*kind is 'video'"):
        mixed_data(mixed_media, sources=[{"path": str(mixed_media.images), "kind": "video"}])
    # a folder keeps only its files of the source's kind (a still beside the clips, uncaptioned, is left out)
    folder = tmp_path / "clips"
    folder.mkdir()
    for p in mixed_media.videos.iterdir():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "thumb.png").write_bytes((mixed_media.images.parent / "wide.png").read_bytes())
    built = mixed_data(mixed_media, sources=[{"path": str(folder), "kind": "video"}])
    assert sorted(s.path.name for s in built.dataset.samples) == sorted(f"{n}.mp4" for n, *_ in MIXED_VIDEOS)
    with pytest.raises(DataCheckError, match=r"caption file missing for thumb\.png"):
        mixed_data(mixed_media, sources=[{"path": str(folder), "kind": "both"}])


def test_data_keys_are_checked_before_work(mixed_media):
    base = {"model": {"path": "m"}}
    with pytest.raises(ConfigError, match=r"give data\.path .* or data\.sources"):
        validate_config({**base, "data": {"path": "x", "sources": [{"path": "y"}]}}, DiTJobConfig)
    with pytest.raises(ConfigError, match=r"data.sources.0.repeats"):
        validate_config({**base, "data": {"sources": [{"path": "y", "repeats": 0}]}}, DiTJobConfig)
    with pytest.raises(ValueError, match="two sources are named 'videos'"):
        mixed_data(mixed_media, sources=[{"path": str(mixed_media.videos)}, {"path": str(mixed_media.videos)}])


# ---------------------------------------------------------------- captions


def test_captions_dropout_several_and_prefix(mixed_media):
    policy = CaptionPolicy(seed=3, dropout=0.3, prefix="sks")
    draws = [policy.choose(("one", "two"), epoch, index) for epoch in range(20) for index in range(20)]
    assert draws == [policy.choose(("one", "two"), e, i) for e in range(20) for i in range(20)]  # deterministic
    empty = draws.count("") / len(draws)
    assert 0.22 < empty < 0.38
    assert {d for d in draws if d} == {"sks one", "sks two"}
    assert CaptionPolicy(seed=4, dropout=0.3).choose(("one",), 0, 0) in ("", "one")
    # through the dataset: each epoch one of a still's two captions, with the prefix; the same epoch, the same
    built = mixed_data(mixed_media, caption_prefix="sks")
    still = next(i for i, s in enumerate(built.dataset.samples) if s.path.stem == "wide")
    seen = set()
    for epoch in range(8):
        built.dataset.set_epoch(epoch)
        caption = built.dataset[still]["caption"]
        assert caption == built.dataset[still]["caption"]
        seen.add(caption)
    assert seen == {"sks a wide still", "sks the wide picture"}


# ---------------------------------------------------------------- lazy index


def write_shards(folder: Path, media: Path, lines: int, image: Path | None = None) -> list[str]:
    """`lines` manifest lines over 3 shards (one in a sub-folder, with a blank line), naming `media`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sub").mkdir(exist_ok=True)
    texts = []
    for i in range(lines):
        line = {"path": str(media), "caption": f"sample {i}", "width": 48, "height": 32, "frames": 9}
        if i % 5 == 1:  # lines the index's quick path hands to the full parse: a caption list, an image
            line["caption"] = [f"sample {i}", f"another {i}"]
        if image is not None and i % 7 == 2:
            line["image"] = str(image)
        texts.append(json.dumps(line))
    parts = [texts[: lines // 3], texts[lines // 3 : 2 * lines // 3], texts[2 * lines // 3 :]]
    (folder / "a.jsonl").write_text("\n".join(parts[0]) + "\n")
    (folder / "b.jsonl").write_text("\n\n".join(parts[1]))  # blank lines, no trailing newline
    (folder / "sub" / "c.jsonl").write_text("\n".join(parts[2]) + "\n")
    return texts


def test_lazy_index_equals_the_in_memory_reading(mixed_media, tmp_path, monkeypatch):
    clip = mixed_media.videos / "wide_a.mp4"
    texts = write_shards(tmp_path / "shards", clip, 30, image=mixed_media.images.parent / "wide.png")
    whole = tmp_path / "whole.jsonl"
    whole.write_text("\n".join(texts) + "\n")
    index = open_manifest(tmp_path / "shards")
    assert list(index) == read_manifest(whole)
    assert [index[i] for i in (0, 11, 29, -1)] == [read_manifest(whole)[i] for i in (0, 11, 29, -1)]
    assert index.sizes.tolist() == [[9, 32, 48]] * 30
    assert pickle.loads(pickle.dumps(index))[17] == index[17]  # loader workers
    # the dataset over the shards: the same samples as over the one manifest
    lazy = build_dataset(tmp_path / "shards", (32, 48), 9)
    assert isinstance(lazy.samples, ShardedManifest) and list(lazy.samples) == list(
        build_dataset(whole, (32, 48), 9).samples
    )

    # a second start reads the cached index, not the shards; a changed shard is indexed again
    def no_build(*args):
        raise AssertionError("index rebuilt")

    monkeypatch.setattr(ShardedManifest, "build", classmethod(no_build))
    assert list(open_manifest(tmp_path / "shards")) == list(index)
    shard = tmp_path / "shards" / "a.jsonl"
    shard.write_text(shard.read_text() + json.dumps({"path": str(clip), "caption": "new"}) + "\n")
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="index rebuilt"):
        open_manifest(tmp_path / "shards")


def test_lazy_index_names_bad_lines_and_empty_captions(tmp_path, mixed_media):
    clip = mixed_media.videos / "wide_a.mp4"
    folder = tmp_path / "bad"
    write_shards(folder, clip, 6)
    (folder / "b.jsonl").write_text(json.dumps({"path": str(clip), "caption": 3}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl, line 1: 'caption' must be a string or a non-empty list"):
        open_manifest(folder)
    (folder / "b.jsonl").write_text(json.dumps({"path": str(clip), "caption": "x", "width": 0, "height": 2}) + "\n")
    with pytest.raises(ValueError, match=r"b.jsonl, line 1: a declared size needs positive integers"):
        open_manifest(folder)
    (folder / "b.jsonl").write_text(json.dumps({"path": str(clip), "caption": " "}) + "\n")
    index = open_manifest(folder)
    assert len(index) == 4 and [p.reason for p in index.problems] == ["empty caption in b.jsonl"]
    assert len(build_dataset(folder, (32, 48), 9, skip_bad_samples=True)) == 4


def test_a_bucketed_epoch_plan_is_split_independent_for_declared_sizes(tmp_path, mixed_media):
    """A manifest declaring sizes needs no probe: its buckets come from the index arrays."""
    folder = tmp_path / "sized"
    write_shards(folder, mixed_media.videos / "wide_a.mp4", 12)
    cfg = MediaDataConfig(path=str(folder), buckets=True, resolution=(32, 48), num_frames=9)
    built = build_dit_data(cfg, lambda: WAN_GRID, seed=0, global_batch_size=4)
    assert built.dataset.plan.shapes == [(9, 32, 48)] and built.stats["rows"] == 12
    assert torch.is_tensor(built.dataset[0]["pixels"])


def test_probed_sizes_of_a_lazy_manifest_are_cached_on_its_shards(tmp_path, mixed_media, monkeypatch):
    """Lines without declared sizes: the files are probed once; a restart reads no manifest line."""
    folder = tmp_path / "probed"
    folder.mkdir()
    stills = [mixed_media.images.parent / f"{name}.png" for name, *_ in MIXED_IMAGES]
    (folder / "a.jsonl").write_text("".join(json.dumps({"path": str(p), "caption": p.stem}) + "\n" for p in stills))
    cfg = MediaDataConfig(path=str(folder), buckets=True, resolution=(32, 48), num_frames=9, skip_bad_samples=True)

    def plan():
        built = build_dit_data(cfg, lambda: WAN_GRID, seed=0, global_batch_size=2, check=False)
        return [built.dataset.plan.shape(i) for i in range(len(built.dataset))]

    first = plan()
    assert first == [BUCKETS[name] for name, *_ in MIXED_IMAGES]

    def no_read(self, index):
        raise AssertionError("a manifest line was read")

    monkeypatch.setattr(ShardedManifest, "read", no_read)
    assert plan() == first
