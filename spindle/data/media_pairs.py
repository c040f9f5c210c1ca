"""Preference pairs of images or videos for Diffusion-DPO (`train.objective: diffusion_dpo`).

`data.path` is a JSONL file, one pair per line, paths relative to the file's folder:

    {"prompt": "a red fox in snow", "chosen": "fox_a.png", "rejected": "fox_b.png"}
    {"prompt": "she turns her head", "chosen": "a.mp4", "rejected": "b.mp4", "image": "first.png"}

`image` is the conditioning image: an image-to-video pair's first frame (optional: default the clip's own), an
edit family's source image(s) (a path or a list, as its requests take them). Checked before any model is
built, as a DiT dataset is: every bad line is named as `file:line` in one error; every file is decoded once
(`spindle.data.media_check`) and the unusable ones are listed (or, with `data.skip_bad_samples`, their pairs are
left out and counted). A pair whose chosen and rejected files are the same file is left out and counted (its
loss carries no gradient).

Resize rule: both members of a pair are decoded at `data.resolution` x `data.num_frames` (with `data.buckets`:
at the bucket the chosen member's size falls in), resized and center-cropped exactly as any DiT sample
(`spindle.data.media.read_media`), so they share one latent shape and draw the same noise and sigma (both carry
the pair's index, the key of the trainer's per-sample generator).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import Dataset

from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import MediaDataset, Sample, collate
from spindle.data.edit_pairs import resolve
from spindle.data.media_check import DataCheckError, Problem, find_problems
from spindle.data.text import bad_lines_message, json_object_line

if TYPE_CHECKING:
    from spindle.contracts.condition import PixelGrid
    from spindle.data.order import BucketedOrder

logger = logging.getLogger(__name__)


@dataclass
class MediaPairs(Dataset):
    """Pair i -> (its chosen sample, its rejected sample), both decoded as `MediaDataset` decodes and both with
    "index" i."""

    chosen: MediaDataset
    rejected: MediaDataset
    stats: dict[str, Any] = field(default_factory=dict)  # for the run summary
    order: BucketedOrder | None = None  # with data.buckets: batches of one bucket (`bucket_pairs`)

    def __len__(self) -> int:
        return len(self.chosen)

    def set_epoch(self, epoch: int) -> None:
        self.chosen.set_epoch(epoch)
        self.rejected.set_epoch(epoch)

    def __getitem__(self, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.chosen.load(index), self.rejected.load(index)

    def members(self) -> MediaDataset:
        """Every member as one dataset, the P chosen then the P rejected, each at its pair's shape: what `spindle
        precompute` encodes (one cache entry each, with the pair's first caption) and what a precomputed run
        reads back (`CachedPairs`)."""
        from spindle.data.buckets import BucketPlan

        members = MediaDataset(
            [*self.chosen.samples, *self.rejected.samples], self.chosen.resolution, self.chosen.num_frames
        )
        if self.chosen.plan is not None:
            plan = self.chosen.plan
            members.plan = BucketPlan(plan.shapes, np.concatenate([plan.ids, plan.ids]))
        members.captions = CaptionPolicy(0, 0.0, self.chosen.captions.prefix, several=False)
        return members


class CachedPairs(Dataset):
    """Pair i -> its chosen and rejected members' cached conditions (`spindle.data.precomputed`: entries i and
    P + i of a cache of `MediaPairs.members()`), both with the pair's index and the same caption draw."""

    def __init__(self, cached: Any, count: int) -> None:
        if len(cached) != 2 * count:
            raise ValueError(f"a cache of {count} pairs holds {2 * count} members; this one holds {len(cached)}")
        self.cached = cached
        self.count = count

    def __len__(self) -> int:
        return self.count

    def set_epoch(self, epoch: int) -> None:
        self.cached.set_epoch(epoch)

    def __getitem__(self, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.cached.load(index, key=index), self.cached.load(self.count + index, key=index)


def collate_cached_pairs(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """P cached pairs -> one batch of 2P samples' conditions: the P chosen, then the P rejected."""
    from spindle.data.precomputed import collate_conditions

    return collate_conditions([c for c, _ in pairs] + [r for _, r in pairs])


def collate_media_pairs(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """P pairs -> one media batch of 2P samples: the P chosen, then the P rejected (`collate`'s keys)."""
    return collate([c for c, _ in pairs] + [r for _, r in pairs])


def _pair(path: Path, lineno: int, line: bytes, edit: bool) -> tuple[Sample, Sample]:
    where = f"{path}:{lineno}"
    entry = json_object_line(where, line, '{"prompt", "chosen", "rejected"}')  # the text data's reader
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
    image = entry.get("image")
    paths = [image] if isinstance(image, str) else image if isinstance(image, list) else None
    if image is not None and (not paths or not all(isinstance(p, str) and p.strip() for p in paths)):
        raise ValueError(f"{where}: 'image' (the conditioning image) must be a path string or a list of them")
    if paths and len(paths) > 1 and not edit:
        raise ValueError(
            f"{where}: 'image' lists {len(paths)} images; an image-to-video pair takes one (its first frame)"
        )
    cond = [resolve(path, p) for p in paths or []]
    # an edit family's pair: the source image(s) of the edit; else the first frame of an image-to-video pair
    given: dict[str, Any] = {"sources": tuple(cond)} if edit else {"image": cond[0] if cond else None}
    return tuple(  # type: ignore[return-value]
        Sample(resolve(path, entry[k]), entry["prompt"], where=where, **given) for k in ("chosen", "rejected")
    )


def read_pairs(path: Path, edit: bool = False) -> tuple[list[tuple[Sample, Sample]], list[str]]:
    """The pairs of a JSONL file and its bad lines (each `file:line: what is wrong`); `edit`: the family edits
    images, so a pair's "image" is its source image(s), else an image-to-video pair's first frame."""
    pairs, errors = [], []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):  # one bad byte: one bad line, not a crash
        if not line.strip():
            continue
        try:
            pairs.append(_pair(path, lineno, line, edit))
        except ValueError as e:
            errors.append(str(e))
    return pairs, errors


def media_pairs(
    data: Any,
    seed: int,
    check: bool = True,
    grid: Callable[[], PixelGrid] | None = None,
    global_batch_size: int = 1,
    sequence_split: int = 1,
    edit: bool = False,
) -> MediaPairs:
    """`data` (a `MediaDataConfig` whose `path` is a pairs JSONL) -> the checked pairs (module doc). With
    `data.buckets` and the model's pixel `grid()`: each pair in the bucket of its chosen member's size, both
    members decoded at that shape, and the epoch order that keeps a batch's pairs in one bucket (`order`);
    `sequence_split`: the SP x ring degree every bucket's token count must divide by; `edit`: an image-edit
    family's pairs ("image": the source images, `read_pairs`)."""
    path = Path(data.path).expanduser()
    if not path.is_file() or path.suffix.lower() != ".jsonl":
        raise ValueError(
            f"train.objective=diffusion_dpo: data.path={path} must be a pairs .jsonl file "
            '(one {"prompt", "chosen", "rejected"} object per line)'
        )
    pairs, errors = read_pairs(path, edit)
    if errors:
        raise ValueError(bad_lines_message(path, errors))
    if not pairs:
        raise ValueError(f"data.path={path} holds no pairs")
    total = len(pairs)
    identical = [p for p in pairs if p[0].path.resolve() == p[1].path.resolve()]
    if identical:
        logger.warning(
            "data.path=%s: %d pair(s) name the same file as chosen and rejected (e.g. %s); left out: such a pair "
            "carries no preference",
            path,
            len(identical),
            identical[0][0].where,
        )
        pairs = [p for p in pairs if p not in identical]
        if not pairs:
            raise ValueError(f"data.path={path}: every pair names the same file as chosen and rejected")
    resolution, frames = (int(data.resolution[0]), int(data.resolution[1])), int(data.num_frames)
    members = [s for pair in pairs for s in pair]
    files = [p for s in members for p in (s.path, s.image, *s.sources) if p]
    problems = [Problem(p, "file does not exist") for p in dict.fromkeys(files) if not p.is_file()]
    if check and not problems:
        bad = find_problems(members, resolution, frames)
        problems = [Problem(members[i].path, f"{reason} ({members[i].where})") for i, reason in sorted(bad.items())]
    if problems and not data.skip_bad_samples:
        raise DataCheckError(path, problems, len(members))
    if problems:
        bad_paths = {p.path for p in problems}
        pairs = [p for p in pairs if not {p[0].path, p[1].path, p[0].image, *p[0].sources} & bad_paths]
        logger.warning("data.skip_bad_samples: left out %d pair(s) with unusable files", total - len(pairs))
        if not pairs:
            raise DataCheckError(path, problems, len(members))
    sides = []
    for k in (0, 1):
        dataset = MediaDataset([p[k] for p in pairs], resolution, frames)
        # the same caption draw for both members (keyed on the pair's index)
        dataset.captions = CaptionPolicy(seed, data.caption_dropout, data.caption_prefix)
        sides.append(dataset)
    stats: dict[str, Any] = {
        "rows": len(pairs),
        "pairs": len(pairs),
        "identical_pairs": len(identical),
        "skipped": total - len(pairs) - len(identical),
    }
    out = MediaPairs(sides[0], sides[1], stats)
    if data.buckets and grid is not None:
        bucket_pairs(out, data, grid(), seed, global_batch_size, sequence_split)
    return out


def bucket_pairs(
    pairs: MediaPairs, data: Any, grid: PixelGrid, seed: int, global_batch_size: int, sequence_split: int
) -> None:
    """`data.buckets` for pairs: the bucket of each pair is the one its chosen member's size falls in (the rule
    of any DiT data: `spindle.data.buckets`), the rejected member is resized and cropped to the same shape (the
    two share one latent shape: the same noise), and the epoch order batches pairs of one bucket together."""
    from spindle.data.buckets import BucketPlan, BucketRule, bucket_report, check_sequence_split, source_sizes
    from spindle.data.dit_data import bucket_knobs
    from spindle.data.order import BucketedOrder

    knobs = bucket_knobs(data)
    rule = BucketRule.make(pairs.chosen.resolution, pairs.chosen.num_frames, grid, knobs)
    plan = BucketPlan.assign(rule, source_sizes(pairs.chosen.samples))
    if plan.unfit == len(pairs):
        raise ValueError(
            f"data.buckets: none of the {len(pairs)} pairs' chosen files fits a bucket (frame buckets "
            f"{list(rule.frames)}, grid {rule.grid.height}x{rule.grid.width}); lower data.num_frames or set "
            "data.buckets.frames"
        )
    check_sequence_split(plan, grid, sequence_split)
    pairs.chosen.plan = pairs.rejected.plan = plan
    pairs.order = BucketedOrder(plan.ids, seed, data.shuffle, knobs.remainder)
    pairs.stats["rows"] = int((plan.ids >= 0).sum())
    pairs.stats["buckets"] = bucket_report(
        plan, pairs.order.global_batches(0, global_batch_size), pairs.order.entries(0)
    )
    pairs.stats["unbucketed"] = plan.unfit
