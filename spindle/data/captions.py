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

    def choose(self, captions: Sequence[str], epoch: int, index: int) -> str:
        """The caption sample `index` trains on in `epoch`."""
        if self.dropout and _uniform(self.seed, epoch, index, "dropout") < self.dropout:
            return ""
        caption = captions[0]
        if len(captions) > 1 and self.several:
            caption = captions[int(_uniform(self.seed, epoch, index, "caption") * len(captions))]
        return f"{self.prefix} {caption}" if self.prefix else caption
