"""The epoch order of a bucketed and/or mixed-source dataset: whole global batches, each from one bucket.

Every rank computes the same plan from (seed, epoch, global batch size) alone, so how a global batch
is split (ranks x micro-batches x accumulation) and where a run resumes never change which samples an
optimizer step sees (`spindle.data.loader.ResumableLoader` cuts the plan's rows into micro-batches).

An epoch: the epoch's entries (`spindle.data.sources.SourceMix`: each sample `repeats x weight` times;
every sample once without sources) are shuffled, grouped by bucket keeping the shuffled order, and
each bucket is cut into global batches; a bucket's last partial batch is padded with the bucket's own
first entries (cycled) or dropped (`data.buckets.remainder`); then the batches themselves are shuffled.
Random draws use numpy's PCG64 seeded with (seed, epoch, purpose): the same on every machine.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_ENTRIES, _BATCHES = 0, 1  # the purposes of the two draws of an epoch


def rng(seed: int, epoch: int, purpose: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, purpose])


class BucketedOrder:
    """`global_batches(epoch, global_batch_size)` -> [steps, global_batch_size] dataset indices."""

    def __init__(
        self,
        bucket_ids: np.ndarray,
        seed: int,
        shuffle: bool = True,
        remainder: str = "pad",
        entries: Callable[[int], np.ndarray] | None = None,
    ):
        self.bucket_ids = bucket_ids
        self.seed = seed
        self.shuffle = shuffle
        self.remainder = remainder
        self.entries = entries or (lambda epoch: np.arange(len(bucket_ids), dtype=np.int64))
        self._cached: tuple[int, int, np.ndarray] | None = None

    def epoch_entries(self, epoch: int) -> np.ndarray:
        """The epoch's entries (dataset indices; a sample fitting no bucket is left out), shuffled."""
        entries = self.entries(epoch)
        entries = entries[self.bucket_ids[entries] >= 0]
        if self.shuffle:
            entries = entries[rng(self.seed, epoch, _ENTRIES).permutation(len(entries))]
        return entries

    def global_batches(self, epoch: int, global_batch_size: int) -> np.ndarray:
        if self._cached is not None and self._cached[:2] == (epoch, global_batch_size):
            return self._cached[2]
        entries = self.epoch_entries(epoch)
        ids = self.bucket_ids[entries]
        rows = []
        for bucket in np.unique(ids):
            members = entries[ids == bucket]  # stable: the shuffled order within the bucket
            whole, left = divmod(len(members), global_batch_size)
            if left and self.remainder == "pad":
                members = np.concatenate([members, np.resize(members, global_batch_size - left)])
            else:
                members = members[: whole * global_batch_size]
            rows.append(members.reshape(-1, global_batch_size))
        batches = np.concatenate(rows) if rows else np.zeros((0, global_batch_size), dtype=np.int64)
        if not len(batches):
            raise ValueError(
                f"epoch {epoch} has no whole global batch of {global_batch_size} samples from one bucket "
                f"({len(entries)} entries): set data.buckets.remainder: pad, or lower train.global_batch_size"
            )
        if self.shuffle:
            batches = batches[rng(self.seed, epoch, _BATCHES).permutation(len(batches))]
        self._cached = (epoch, global_batch_size, batches)
        return batches
