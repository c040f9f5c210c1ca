"""Preference pairs of images or videos for Diffusion-DPO (`train.objective: diffusion_dpo`).

`data.path` is a JSONL file, one pair per line, paths relative to the file's folder:

    {"prompt": "a red fox in snow", "chosen": "fox_a.png", "rejected": "fox_b.png"}
    {"prompt": "she turns her head", "chosen": "a.mp4", "rejected": "b.mp4", "image": "first.png"}

`image` is the conditioning image of image-to-video / edit families (optional). Checked before any model is
built, as a DiT dataset is: every bad line is named as `file:line` in one error; every file is decoded once
(`spindle.data.media_check`) and the unusable ones are listed (or, with `data.skip_bad_samples`, their pairs are
left out and counted). A pair whose chosen and rejected files are the same file is left out and counted (its
loss carries no gradient).

Resize rule: both members of a pair are decoded at `data.resolution` x `data.num_frames`, resized and
center-cropped exactly as any DiT sample (`spindle.data.media.read_media`), so they share one latent shape and
draw the same noise and sigma (both carry the pair's index, the key of the trainer's per-sample generator).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from spindle.data.captions import CaptionPolicy
from spindle.data.datasets import MediaDataset, Sample, collate
from spindle.data.edit_pairs import resolve
from spindle.data.media_check import DataCheckError, Problem, find_problems
from spindle.data.text import json_line

logger = logging.getLogger(__name__)


@dataclass
class MediaPairs(Dataset):
    """Pair i -> (its chosen sample, its rejected sample), both decoded as `MediaDataset` decodes and both with
    "index" i."""

    chosen: MediaDataset
    rejected: MediaDataset
    stats: dict[str, Any] = field(default_factory=dict)  # for the run summary

    def __len__(self) -> int:
        return len(self.chosen)

    def set_epoch(self, epoch: int) -> None:
        self.chosen.set_epoch(epoch)
        self.rejected.set_epoch(epoch)

    def __getitem__(self, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return self.chosen.load(index), self.rejected.load(index)


def collate_media_pairs(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """P pairs -> one media batch of 2P samples: the P chosen, then the P rejected (`collate`'s keys)."""
    return collate([c for c, _ in pairs] + [r for _, r in pairs])


def _pair(path: Path, lineno: int, line: bytes) -> tuple[Sample, Sample]:
    where = f"{path}:{lineno}"
    try:
        entry = json_line(line)  # the JSONL reader the text data uses: not UTF-8, not JSON, each said
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if not isinstance(entry, dict):
        raise ValueError(f'{where}: expected an object {{"prompt", "chosen", "rejected"}}')
    for key in ("prompt", "chosen", "rejected"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ValueError(f"{where}: {key!r} must be a non-empty string")
    image = entry.get("image")
    if image is not None and not isinstance(image, str):
        raise ValueError(f"{where}: 'image' (the conditioning image) must be a path string")
    cond = resolve(path, image) if image else None
    return tuple(  # type: ignore[return-value]
        Sample(resolve(path, entry[k]), entry["prompt"], image=cond, where=where) for k in ("chosen", "rejected")
    )


def read_pairs(path: Path) -> tuple[list[tuple[Sample, Sample]], list[str]]:
    """The pairs of a JSONL file and its bad lines (each `file:line: what is wrong`)."""
    pairs, errors = [], []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):  # one bad byte: one bad line, not a crash
        if not line.strip():
            continue
        try:
            pairs.append(_pair(path, lineno, line))
        except ValueError as e:
            errors.append(str(e))
    return pairs, errors


def media_pairs(data: Any, seed: int, check: bool = True) -> MediaPairs:
    """`data` (a `MediaDataConfig` whose `path` is a pairs JSONL) -> the checked pairs (module doc)."""
    path = Path(data.path).expanduser()
    if not path.is_file() or path.suffix.lower() != ".jsonl":
        raise ValueError(
            f"train.objective=diffusion_dpo: data.path={path} must be a pairs .jsonl file "
            '(one {"prompt", "chosen", "rejected"} object per line)'
        )
    pairs, errors = read_pairs(path)
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise ValueError(f"data.path={path}: {len(errors)} bad line(s):\n  {shown}")
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
    problems = [Problem(p, "file does not exist") for s in members for p in (s.path, s.image) if p and not p.is_file()]
    if check and not problems:
        bad = find_problems(members, resolution, frames)
        problems = [Problem(members[i].path, f"{reason} ({members[i].where})") for i, reason in sorted(bad.items())]
    if problems and not data.skip_bad_samples:
        raise DataCheckError(path, problems, len(members))
    if problems:
        bad_paths = {p.path for p in problems}
        pairs = [p for p in pairs if not {p[0].path, p[1].path, p[0].image} & bad_paths]
        logger.warning("data.skip_bad_samples: left out %d pair(s) with unusable files", total - len(pairs))
        if not pairs:
            raise DataCheckError(path, problems, len(members))
    sides = []
    for k in (0, 1):
        dataset = MediaDataset([p[k] for p in pairs], resolution, frames)
        # the same caption draw for both members (keyed on the pair's index)
        dataset.captions = CaptionPolicy(seed, data.caption_dropout, data.caption_prefix)
        sides.append(dataset)
    stats = {"rows": len(pairs), "pairs": len(pairs), "identical_pairs": len(identical), "skipped": total - len(pairs)}
    stats["skipped"] -= len(identical)
    return MediaPairs(sides[0], sides[1], stats)
