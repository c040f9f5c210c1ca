"""Count host reads of tensor values: on an accelerator each one is a host-device synchronisation.

`with HostReads() as reads: trainer.train_step()` -> `reads.calls` lists every `item()`, `float(t)`,
`int(t)`, `bool(t)` (an `if tensor:`), `tolist()`, `numpy()` and `.cpu()` that ran, with the
caller's file:line. The count is the same on CPU, where nothing waits, so tests and benches can
check the training step's syncs without a GPU (torch's `cuda.set_sync_debug_mode` only sees CUDA).
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from torch.overrides import TorchFunctionMode

READS = frozenset({"item", "__float__", "__int__", "__index__", "__bool__", "tolist", "numpy", "cpu"})


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []  # (what, where)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS:
            # the innermost caller outside torch and this module: the line that reads the tensor
            here = __file__
            frame = next(
                f
                for f in reversed(traceback.extract_stack())
                if f.filename != here and f"{os.sep}torch{os.sep}" not in f.filename
            )
            self.calls.append((name, f"{frame.filename}:{frame.lineno}"))
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return len(self.calls)
