"""A DiT job's dataset as its `data:` section describes it: one path or several sources, buckets,
caption handling, and the epoch order that goes with them (training, `spindle precompute`).

`build_dit_data` is the one place that reads those keys, so the training task and precompute decode
exactly the same samples at the same shapes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from spindle.contracts.condition import AudioTrack, PixelGrid
from spindle.data.buckets import BucketPlan, BucketRule, bucket_report, check_sequence_split, source_sizes
from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import MediaDataset, Sample, build_dataset
from spindle.data.order import BucketedOrder
from spindle.data.sources import SourceMix, source_name


class ConcatSamples(Sequence[Sample]):
    """The samples of several sources one after another, each part kept as it is (lazy stays lazy)."""

    def __init__(self, parts: list[Sequence[Sample]]):
        self.parts = parts
        self.bounds = np.cumsum([len(p) for p in parts]).tolist()

    def __len__(self) -> int:
        return self.bounds[-1] if self.bounds else 0

    @overload
    def __getitem__(self, index: int) -> Sample: ...
    @overload
    def __getitem__(self, index: slice) -> list[Sample]: ...
    def __getitem__(self, index: int | slice) -> Sample | list[Sample]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        part = bisect.bisect_right(self.bounds, index)
        return self.parts[part][index - (self.bounds[part - 1] if part else 0)]

    def __iter__(self) -> Iterator[Sample]:
        for part in self.parts:
            yield from part

    @property
    def sizes(self) -> np.ndarray | None:
        sizes = [declared_sizes(p) for p in self.parts]
        return None if any(s is None for s in sizes) else np.concatenate([s for s in sizes if s is not None])


def declared_sizes(samples: Sequence[Sample]) -> np.ndarray | None:
    """[n, 3] sizes the manifest lines declare, when every one does (lazy indexes keep them as an array)."""
    if hasattr(samples, "sizes"):
        sizes: np.ndarray | None = samples.sizes
        return sizes
    found = [s.size for s in samples]
    return None if any(s is None for s in found) else np.asarray(found, dtype=np.int32).reshape(len(found), 3)


@dataclass
class DiTData:
    dataset: MediaDataset
    order: BucketedOrder | None = None  # None: the loader's plain order (one shape, one source)
    mix: SourceMix | None = None
    stats: dict[str, Any] = field(default_factory=dict)  # for the run summary (buckets: the histogram)


def bucket_knobs(data: Any) -> Any:
    from spindle.config import BucketsConfig

    return BucketsConfig() if data.buckets is True else data.buckets


def build_dit_data(
    data: Any,
    grid: Callable[[], PixelGrid] | None,
    seed: int,
    global_batch_size: int,
    check: bool = True,
    warn_skipped: bool = True,
    captions: bool = True,
    sequence_split: int = 1,
    audio: AudioTrack | None = None,
) -> DiTData:
    """`data` (a `MediaDataConfig`) -> the dataset, its order and its start-up report. `grid()` gives the
    model's pixel grid (called only with buckets on); None: list and check the samples only. `captions=False`: every sample with its first
    caption and the prefix, never dropped (what a precomputed cache holds). `sequence_split`: the SP x ring
    degree every bucket's token count must divide by. `audio` (`data.audio`): each clip's soundtrack is
    read (and checked) in this format."""
    resolution, frames = (int(data.resolution[0]), int(data.resolution[1])), int(data.num_frames)

    def one(path: str, kind: str = "both", control_dir: str | None = None) -> MediaDataset:
        return build_dataset(
            path, resolution, frames, data.skip_bad_samples, check, warn_skipped, kind, control_dir, audio
        )

    mix = None
    if data.sources:
        if data.control_dir is not None:
            raise ValueError(
                "data.control_dir pairs a data.path folder with its sources; with data.sources give "
                'each edit pair its source images in a manifest ("image")'
            )
        names = [source_name(s) for s in data.sources]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"data.sources: two sources are named {repeated[0]!r}; give each a distinct name")
        parts = [one(s.path, s.kind) for s in data.sources]
        ids = np.concatenate([np.full(len(p), k, dtype=np.int32) for k, p in enumerate(parts)])
        mix = SourceMix(names, ids, [s.repeats * s.weight for s in data.sources], seed)
        dataset = MediaDataset(
            ConcatSamples([p.samples for p in parts]), resolution, frames, skip_bad_samples=data.skip_bad_samples
        )
        dataset.skipped_files = [f for p in parts for f in p.skipped_files]
        dataset.audio = audio
    else:
        dataset = one(data.path, control_dir=data.control_dir)
    dropout = data.caption_dropout if captions else 0.0
    dataset.captions = CaptionPolicy(seed, dropout, data.caption_prefix, several=captions)
    n = len(dataset)
    plan = BucketPlan.single(frames, resolution, n)
    if grid is None:
        return DiTData(dataset)
    if data.buckets:
        knobs = bucket_knobs(data)
        pixel_grid = grid()
        rule = BucketRule.make(resolution, frames, pixel_grid, knobs)
        sizes = declared_sizes(dataset.samples)
        plan = BucketPlan.assign(rule, sizes if sizes is not None else source_sizes(dataset.samples))
        if plan.unfit == n:
            raise ValueError(
                f"data.buckets: none of the {n} samples fits a bucket (frame buckets {list(rule.frames)}, "
                f"grid {rule.grid.height}x{rule.grid.width}); lower data.num_frames or set data.buckets.frames"
            )
        check_sequence_split(plan, pixel_grid, sequence_split)
        dataset.plan = plan
    order = None
    if data.buckets or mix is not None:
        remainder = bucket_knobs(data).remainder if data.buckets else "pad"
        entries = mix.epoch_entries if mix is not None else None
        order = BucketedOrder(plan.ids, seed, data.shuffle, remainder, entries)
    rows = n if order is None else int((plan.ids[order.entries(0)] >= 0).sum())
    stats: dict[str, Any] = {"rows": rows, "samples": n, "skipped": len(dataset.skipped_files)}
    if mix is not None:
        stats["sources"] = mix.summary()
    if data.buckets and order is not None:
        batches = order.global_batches(0, global_batch_size)
        stats["buckets"] = bucket_report(plan, batches, order.entries(0))
        stats["unbucketed"] = plan.unfit
    return DiTData(dataset, order, mix, stats)
