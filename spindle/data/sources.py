"""Several datasets mixed into one (`data.sources`): kinds, repeats and weights.

Each source is a folder, a .jsonl manifest or a folder of .jsonl shards (as `data.path`), listed in the
order given; the dataset is their concatenation, and `SourceMix` says how often each source's samples
appear per epoch:

- `kind`: `video`, `image` or `both` media files of the source are used. A manifest line of the other
  kind is an error naming it; a folder's files of the other kind are left out and counted (a folder of
  clips often holds thumbnails). For a video family an image is a one-frame video.
- `repeats`: every sample appears `repeats` times per epoch (a small dataset among large ones).
- `weight`: a multiplier on top: `repeats x weight` copies per epoch; the whole part as copies of every
  sample, the fraction as a subset drawn anew each epoch from (seed, epoch, source), so weight 0.5
  trains on a different half of the source every epoch and the epoch length stays fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spindle.data.media import is_image_path, is_video_path

_SOURCE_DRAW = 2  # the purpose of a source's fractional draw (spindle.data.order.rng)


def source_name(source: Any) -> str:
    return source.name or Path(source.path).expanduser().name


def of_kind(path: Path, kind: str) -> bool:
    return kind == "both" or (is_video_path(path) if kind == "video" else is_image_path(path))


@dataclass
class SourceMix:
    """Sample i belongs to source `ids[i]`; per-epoch entries follow each source's repeats and weight."""

    names: list[str]
    ids: np.ndarray
    copies: list[float]  # repeats x weight per source
    seed: int = 0

    def epoch_entries(self, epoch: int) -> np.ndarray:
        from spindle.data.order import rng

        parts = []
        for s, copies in enumerate(self.copies):
            members = np.flatnonzero(self.ids == s)
            whole = int(copies)
            parts.extend([members] * whole)
            extra = round((copies - whole) * len(members))
            if extra:
                chosen = rng(self.seed, epoch, _SOURCE_DRAW + s).permutation(len(members))[:extra]
                parts.append(members[np.sort(chosen)])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def counts(self, indices: Any) -> dict[str, int]:
        """How many of `indices` (dataset indices) come from each source."""
        found = np.bincount(self.ids[np.asarray(indices, dtype=np.int64)], minlength=len(self.names))
        return {name: int(found[s]) for s, name in enumerate(self.names)}

    def summary(self) -> dict[str, dict[str, Any]]:
        sizes = np.bincount(self.ids, minlength=len(self.names))
        return {
            name: {"samples": int(sizes[s]), "per_epoch": round(float(sizes[s]) * self.copies[s])}
            for s, name in enumerate(self.names)
        }
