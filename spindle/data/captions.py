"""Caption handling: several captions per sample, caption dropout, a fixed prefix (trigger word).

- several captions: a manifest line's `"caption"` may be a list of strings; each epoch one is drawn;
- `data.caption_dropout`: the probability that a sample trains on the empty caption, so the model
  learns the unconditional prediction that classifier-free guidance needs;
- `data.caption_prefix`: put before every (non-dropped) caption, e.g. a LoRA's trigger word.

Every draw is a function of (seed, epoch, sample index): every rank, split and resumed run agrees.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


def _uniform(seed: int, epoch: int, index: int, purpose: str) -> float:
    """A deterministic draw in [0, 1) keyed on (seed, epoch, index, purpose)."""
    digest = hashlib.blake2b(f"{purpose}:{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


@dataclass(frozen=True)
class CaptionPolicy:
    seed: int = 0
    dropout: float = 0.0
    prefix: str = ""
    several: bool = True  # false: always the first caption (what a precomputed cache holds)

    @property
    def active(self) -> bool:
        return bool(self.dropout or self.prefix)

    def pick(self, count: int, epoch: int, index: int) -> int | None:
        """Which of a sample's `count` captions it trains on in `epoch`; None: the empty caption."""
        if self.dropout and _uniform(self.seed, epoch, index, "dropout") < self.dropout:
            return None
        if count > 1 and self.several:
            return int(_uniform(self.seed, epoch, index, "caption") * count)
        return 0

    def text(self, caption: str) -> str:
        """A caption with the prefix."""
        return f"{self.prefix} {caption}" if self.prefix else caption

    def choose(self, captions: Sequence[str], epoch: int, index: int) -> str:
        """The caption sample `index` trains on in `epoch`."""
        j = self.pick(len(captions), epoch, index)
        return "" if j is None else self.text(captions[j])
