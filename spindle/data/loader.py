"""Deterministic, resumable, data-parallel batching.

Which samples a rank sees depends only on (seed, epoch, position, dp_rank, dp_size, len(dataset)),
never on worker timing, so a run resumed from `state_dict()` sees exactly the batches the
uninterrupted run would have seen, and all ranks agree on the epoch's order without communicating.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from spindle.data.datasets import collate


class ResumableLoader:
    """Infinite iterator of collated micro-batches for one data-parallel rank.

    Each epoch every rank computes the same order: `torch.randperm(len(dataset))` from a generator
    seeded with `seed + epoch` (or `arange` without shuffle). The order is cut into global batches of
    `micro_batch_size * dp_size` samples; rank r takes the contiguous slice
    [r * micro_batch_size, (r + 1) * micro_batch_size) of each, so the ranks of one step see
    disjoint samples that together form the global batch.

    The tail that does not fill a whole optimizer step (`grad_accum` rounds of `micro_batch_size *
    dp_size`) is dropped: every rank must run the same number of steps, or collectives would hang, and
    each optimizer step must see the same samples whatever the split into micro-batches and ranks
    (dropping only a partial round would let an accumulating run take a step across the epoch end).
    A dataset smaller than one optimizer step is repeated (cycled in the epoch's order) to fill
    exactly one step, so a tiny dataset still trains
    (some samples then appear twice in a step) instead of yielding nothing.

    `state_dict()` = {"epoch", "position"}: position counts micro-batches already returned in this
    epoch. With `num_workers > 0` a torch DataLoader decodes the fixed index lists ahead of time;
    prefetching does not move the position, which only advances when a batch is returned.
    """

    def __init__(
        self,
        dataset: Dataset,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] = collate,
        grad_accum: int = 1,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size; got dp_rank={dp_rank}, dp_size={dp_size}")
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1; got {grad_accum}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("ResumableLoader got an empty dataset")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.grad_accum = grad_accum
        self.epoch = 0
        self.position = 0
        self._batches: Iterator[Any] | None = None

    # ------------------------------------------------------------------ index arithmetic

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (= optimizer micro-steps of every rank): whole optimizer steps."""
        step = self.global_batch_size * self.grad_accum
        return max(1, len(self.dataset) // step) * self.grad_accum  # type: ignore[arg-type]

    def epoch_order(self, epoch: int) -> list[int]:
        """The global sample order of `epoch`, already cut/padded to whole global batches."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        needed = self.steps_per_epoch * self.global_batch_size
        if needed > n:  # dataset smaller than one global batch: cycle through it
            order = order.repeat((needed + n - 1) // n)
        return order[:needed].tolist()

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches (lists of dataset indices) for the whole of `epoch`."""
        order = self.epoch_order(epoch)
        gbs, mbs = self.global_batch_size, self.micro_batch_size
        start = self.dp_rank * mbs
        return [order[s * gbs + start : s * gbs + start + mbs] for s in range(self.steps_per_epoch)]

    # ------------------------------------------------------------------ iteration

    def _epoch_iterator(self, epoch: int, start: int) -> Iterator[Any]:
        batches = self.rank_batches(epoch)[start:]
        if self.num_workers == 0:
            return (self.collate_fn([self.dataset[i] for i in batch]) for batch in batches)
        loader = DataLoader(
            self.dataset, batch_sampler=batches, num_workers=self.num_workers, collate_fn=self.collate_fn
        )
        return iter(loader)

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
            self._batches = None
        if self._batches is None:
            self._batches = self._epoch_iterator(self.epoch, self.position)
        batch = next(self._batches)
        self.position += 1
        return batch

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise KeyError(f"loader state is missing {sorted(missing)}; got keys {sorted(state)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.steps_per_epoch:
            raise ValueError(
                f"loader state epoch={epoch}, position={position} is out of range: this loader has "
                f"{self.steps_per_epoch} steps per epoch (did the dataset, micro_batch_size or dp_size change?)"
            )
        self.epoch, self.position = epoch, position
        self._batches = None  # drops any prefetched batches; rebuilt from the restored position
