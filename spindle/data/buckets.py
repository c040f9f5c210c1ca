"""Aspect-ratio and frame-count buckets (`data.buckets`).

Cropping every sample to one `data.resolution` throws composition away and teaches a model to crop.
With buckets each sample is resized and center-cropped to the bucket nearest its own shape instead:

- **aspect buckets**: every (height, width) on the family's pixel grid (`ConditionModel.pixel_grid`:
  VAE downsampling x patch size, read from the checkpoint) whose area is about `resolution`'s and whose
  long side / short side is at most `max_aspect`; a sample goes to the one nearest its aspect ratio
  (in log space). A source smaller than its bucket is never enlarged unless `upscale`: its own size,
  rounded down to the grid, is its bucket (smaller area);
- **frame buckets**: the frame counts the family takes (`k * frame_multiple + 1` for Wan) up to
  `num_frames`, or the `frames` knob; a clip goes to the longest one it can fill (its frames are
  sampled evenly over the whole clip, as without buckets), an image to 1 frame.

A sample that fits no bucket (smaller than one grid cell, or shorter than every frame bucket) is left
out and counted in the report. The loader (`spindle.data.order`) draws every global batch from one
bucket. Source sizes are probed from file headers, never decoded, and cached per dataset.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from spindle.contracts.condition import PixelGrid
from spindle.data.media import MediaError, is_video_path, probe_video

Shape = tuple[int, int, int]  # (frames, height, width)
_EXIF_ORIENTATION = 274  # EXIF tag: values 5-8 rotate by 90 degrees (read_image applies them)


def aspect_buckets(resolution: tuple[int, int], grid: PixelGrid, max_aspect: float) -> list[tuple[int, int]]:
    """Every grid (height, width) of about `resolution`'s area with aspect ratio within `max_aspect`."""
    area = resolution[0] * resolution[1]
    out: set[tuple[int, int]] = set()
    height = grid.height
    while height <= math.sqrt(area * max_aspect) + grid.height:
        width = max(grid.width, round(area / height / grid.width) * grid.width)
        if max(height / width, width / height) <= max_aspect:
            out.add((height, width))
        height += grid.height
    if not out:
        raise ValueError(
            f"data.buckets: no bucket of about {resolution[0]}x{resolution[1]} pixels fits the model's grid "
            f"({grid.height}x{grid.width}) within max_aspect {max_aspect}; raise data.resolution or max_aspect"
        )
    return sorted(out)


def frame_buckets(grid: PixelGrid, num_frames: int, frames: Sequence[int] | None) -> list[int]:
    """The frame-count buckets: `frames` (each checked against the family's rule) or every count it takes."""
    if frames is None:
        return grid.frame_counts(num_frames)
    valid = set(grid.frame_counts(max(frames, default=1)))
    bad = sorted(f for f in frames if f not in valid)
    if bad or not frames:
        rule = "1 (an image family)" if grid.frame_multiple is None else f"{grid.frame_multiple}k+1"
        raise ValueError(
            f"data.buckets.frames: {bad or 'an empty list'} not taken by this model; counts must be {rule}"
        )
    return sorted(set(frames))


@dataclass(frozen=True)
class BucketRule:
    """How a source shape maps to a bucket shape."""

    aspects: tuple[tuple[int, int], ...]
    frames: tuple[int, ...]
    grid: PixelGrid
    upscale: bool = False

    @classmethod
    def make(cls, resolution: tuple[int, int], num_frames: int, grid: PixelGrid, knobs: Any) -> BucketRule:
        aspects = aspect_buckets(resolution, grid, knobs.max_aspect)
        return cls(tuple(aspects), tuple(frame_buckets(grid, num_frames, knobs.frames)), grid, knobs.upscale)

    def bucket(self, frames: int, height: int, width: int) -> Shape | None:
        """The bucket of a source of `frames` x `height` x `width`, or None when none fits."""
        fits = [f for f in self.frames if f <= frames]
        if not fits or height <= 0 or width <= 0:
            return None
        target = math.log(height / width)
        bh, bw = min(self.aspects, key=lambda hw: (abs(math.log(hw[0] / hw[1]) - target), -hw[0] * hw[1]))
        if not self.upscale and (bh > height or bw > width):
            # the source's own size down to the grid (as kohya's bucket_no_upscale): the least cropped
            bh, bw = height // self.grid.height * self.grid.height, width // self.grid.width * self.grid.width
            if not bh or not bw:
                return None
        return (max(fits), bh, bw)


def media_size(path: Path) -> Shape:
    """(frames, height, width) of a media file from its header (images: 1 frame, EXIF rotation applied)."""
    if is_video_path(path):
        frames, _, width, height = probe_video(path)
        return (frames, height, width)
    try:
        with Image.open(path) as img:
            width, height = img.size
            rotated = img.getexif().get(_EXIF_ORIENTATION, 1) in (5, 6, 7, 8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(path, f"unreadable image ({exc.__class__.__name__}: {exc})") from exc
    return (1, width, height) if rotated else (1, height, width)


def _cache_file(samples: Sequence[Any]) -> Path:
    from spindle.data.media_check import cache_dir

    digest = hashlib.sha256(b"sizes:1")
    identity = getattr(samples, "identity", None)
    if identity is not None:  # a lazy index: keyed on its shards, not on a stat of every media file
        digest.update(identity.encode())
        return cache_dir() / f"sizes-{digest.hexdigest()[:32]}.npy"
    for sample in samples:
        st = sample.path.stat()
        digest.update(f"{sample.path}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return cache_dir() / f"sizes-{digest.hexdigest()[:32]}.npy"


def source_sizes(samples: Sequence[Any]) -> np.ndarray:
    """[n, 3] int32 (frames, height, width) of every sample: the size its manifest line declares, else
    probed from the file header (cached per dataset, keyed on every file's size and mtime; for a lazy
    manifest index, on its shards' and the selection's identity, so a restart reads no line). A file that
    cannot be probed gets (0, 0, 0), so it fits no bucket."""
    cache = _cache_file(samples)
    try:
        sizes = np.load(cache)
        if sizes.shape == (len(samples), 3):
            return sizes
    except (OSError, ValueError):
        pass  # absent or unreadable: probe again
    sizes = np.zeros((len(samples), 3), dtype=np.int32)
    for i, sample in enumerate(samples):
        try:
            sizes[i] = sample.size if sample.size is not None else media_size(sample.path)
        except MediaError:
            continue  # reported as fitting no bucket (or by the decode check)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npy")
        np.save(tmp, sizes)
        tmp.replace(cache)
    except OSError:
        pass  # a read-only cache only costs the next run a re-probe
    return sizes


@dataclass
class BucketPlan:
    """Each sample's bucket: `ids[i]` indexes `shapes` (-1: no bucket fits, the sample is not used)."""

    shapes: list[Shape]
    ids: np.ndarray

    @classmethod
    def assign(cls, rule: BucketRule, sizes: np.ndarray) -> BucketPlan:
        # once per distinct source size (a large dataset has few), then spread back to the samples
        sizes = np.clip(sizes.reshape(-1, 3).astype(np.int64), 0, 2**21 - 1)
        keys = (sizes[:, 0] << 42) | (sizes[:, 1] << 21) | sizes[:, 2]  # one int64 a size: a fast 1-D unique
        distinct, inverse = np.unique(keys, return_inverse=True)
        mask = 2**21 - 1
        per_size = [rule.bucket(int(k >> 42), int((k >> 21) & mask), int(k & mask)) for k in distinct]
        shapes = sorted({s for s in per_size if s is not None})
        lookup = {shape: i for i, shape in enumerate(shapes)}
        ids = np.asarray([-1 if s is None else lookup[s] for s in per_size], dtype=np.int32)
        return cls(shapes, ids[inverse.reshape(-1)] if len(ids) else np.zeros(0, dtype=np.int32))

    @classmethod
    def single(cls, num_frames: int, resolution: tuple[int, int], n: int) -> BucketPlan:
        """No buckets: every sample at the one configured shape."""
        return cls([(num_frames, resolution[0], resolution[1])], np.zeros(n, dtype=np.int32))

    def shape(self, index: int) -> Shape:
        return self.shapes[int(self.ids[index])]

    @property
    def unfit(self) -> int:
        return int((self.ids < 0).sum())


def shape_name(shape: Shape) -> str:
    return f"{shape[0]}x{shape[1]}x{shape[2]}"


def bucket_report(plan: BucketPlan, batches: np.ndarray, entries: np.ndarray) -> dict[str, dict[str, int]]:
    """Per bucket (`FxHxW`): samples in it, and over one epoch how many of its entries were padded (repeats
    filling its last global batch) or dropped (data.buckets.remainder: drop)."""
    report = {}
    used = np.bincount(plan.ids[batches.reshape(-1)], minlength=len(plan.shapes)) if batches.size else None
    listed = np.bincount(plan.ids[entries][plan.ids[entries] >= 0], minlength=len(plan.shapes))
    members = np.bincount(plan.ids[plan.ids >= 0], minlength=len(plan.shapes))
    for b, shape in enumerate(plan.shapes):
        took = int(used[b]) if used is not None else 0
        report[shape_name(shape)] = {
            "samples": int(members[b]),
            "padded": max(0, took - int(listed[b])),
            "dropped": max(0, int(listed[b]) - took),
        }
    return report


def shape_tokens(shape: Shape, grid: PixelGrid) -> int:
    """A sample's latent token count: latent frames x (height / grid) x (width / grid), the grid being VAE x
    patch."""
    frames, height, width = shape
    latent_frames = 1 if grid.frame_multiple is None else (frames - 1) // grid.frame_multiple + 1
    return latent_frames * (height // grid.height) * (width // grid.width)


def check_sequence_split(plan: BucketPlan, grid: PixelGrid, degree: int) -> None:
    """Sequence parallelism splits every sample's tokens over `degree` ranks: each bucket's token count
    (`shape_tokens`) must divide by it."""
    bad = []
    for shape in plan.shapes:
        tokens = shape_tokens(shape, grid)
        if tokens % degree:
            bad.append(f"{shape_name(shape)} ({tokens} tokens)")
    if bad:
        raise ValueError(
            f"data.buckets: sequence parallelism splits each sample over {degree} ranks, but bucket(s) "
            f"{', '.join(bad)} do not divide evenly; set data.buckets.upscale: true (small sources join a full-size "
            "bucket), data.buckets.frames, or leave out the small/short sources"
        )
