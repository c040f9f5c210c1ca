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
from spindle.data.order import BucketedOrder


class ResumableLoader:
    """Infinite iterator of collated micro-batches for one data-parallel rank.

    The order is a function of (seed, epoch, global batch size) only, never of how a global batch
    is split: each epoch every rank computes the same permutation (`torch.randperm(len(dataset))`
    from a generator seeded with `seed + epoch`, or `arange` without shuffle) and cuts it into
    global batches of `global_batch_size` samples, dropping the tail that does not fill a whole
    global batch (every rank must run the same number of steps, or collectives would hang). A
    global batch is then split into `accum` micro-steps of `dp_size` ranks x `micro_batch_size`
    samples: micro-step a, rank r takes the contiguous slice starting at (a * dp_size + r) *
    micro_batch_size. So 2 ranks x 2, 1 rank x 4, and 1 rank x 1 with 4 accumulation steps see the
    same samples in the same optimizer steps, across epoch boundaries and across resumes at another
    world size. A dataset smaller than one global batch is repeated (cycled in the epoch's order) to
    fill exactly one global batch, so a tiny dataset still trains.

    `state_dict()` = {"epoch", "position"}: position counts micro-batches already returned in this
    epoch by this rank. With `num_workers > 0` a torch DataLoader decodes the fixed index lists ahead
    of time; prefetching does not move the position, which only advances when a batch is returned.
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
        global_batch_size: int | None = None,
        order: BucketedOrder | None = None,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size; got dp_rank={dp_rank}, dp_size={dp_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0; got {num_workers}")
        if len(dataset) == 0:  # type: ignore[arg-type]
            raise ValueError("ResumableLoader got an empty dataset")
        per_round = micro_batch_size * dp_size
        global_batch_size = per_round if global_batch_size is None else global_batch_size
        if global_batch_size < 1 or global_batch_size % per_round:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a positive multiple of micro_batch_size x dp_size "
                f"({micro_batch_size} x {dp_size} = {per_round})"
            )
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.global_batch_size = global_batch_size
        self.accum = global_batch_size // per_round
        # bucketed / mixed-source data: whole global batches from `spindle.data.order` (None: the plain order)
        self.order = order
        self.epoch = 0
        self.position = 0
        self._batches: Iterator[Any] | None = None

    # ------------------------------------------------------------------ index arithmetic

    @property
    def global_steps_per_epoch(self) -> int:
        """Optimizer steps per epoch (whole global batches)."""
        return max(1, len(self.dataset) // self.global_batch_size)  # type: ignore[arg-type]

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank per epoch (= forward passes of every rank), in the current epoch."""
        return self.steps_in(self.epoch)

    def steps_in(self, epoch: int) -> int:
        """Micro-batches per rank in `epoch` (a bucketed epoch's count follows its sources' draws)."""
        if self.order is not None:
            return len(self.order.global_batches(epoch, self.global_batch_size)) * self.accum
        return self.global_steps_per_epoch * self.accum

    def epoch_order(self, epoch: int) -> list[int]:
        """The global sample order of `epoch`, already cut/padded to whole global batches."""
        if self.order is not None:
            planned: list[int] = self.order.global_batches(epoch, self.global_batch_size).reshape(-1).tolist()
            return planned
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        needed = self.global_steps_per_epoch * self.global_batch_size
        if needed > n:  # dataset smaller than one global batch: cycle through it
            order = order.repeat((needed + n - 1) // n)
        return order[:needed].tolist()

    def rank_batches(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches (lists of dataset indices) for the whole of `epoch`."""
        order = self.epoch_order(epoch)
        mbs = self.micro_batch_size
        starts = (
            step * self.global_batch_size + (micro * self.dp_size + self.dp_rank) * mbs
            for step in range(len(order) // self.global_batch_size)
            for micro in range(self.accum)
        )
        return [order[start : start + mbs] for start in starts]

    # ------------------------------------------------------------------ iteration

    def current_global_batch(self) -> list[int]:
        """The dataset indices of the global batch the last returned micro-batch belongs to (every rank's)."""
        step = max(self.position - 1, 0) // self.accum
        if self.order is not None:  # a row of the epoch's plan (no list of the whole epoch per step)
            row: list[int] = self.order.global_batches(self.epoch, self.global_batch_size)[step].tolist()
            return row
        return self.epoch_order(self.epoch)[step * self.global_batch_size : (step + 1) * self.global_batch_size]

    def _epoch_iterator(self, epoch: int, start: int) -> Iterator[Any]:
        batches = self.rank_batches(epoch)[start:]
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if set_epoch is not None:  # per-epoch draws (captions); workers get the dataset pickled after this
            set_epoch(epoch)
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
        if epoch < 0 or not 0 <= position <= self.steps_in(epoch):
            raise ValueError(
                f"loader state epoch={epoch}, position={position} is out of range: this loader has "
                f"{self.steps_in(max(epoch, 0))} steps per epoch (did the dataset, micro_batch_size or dp_size change?)"
            )
        self.epoch, self.position = epoch, position
        self._batches = None  # drops any prefetched batches; rebuilt from the restored position
