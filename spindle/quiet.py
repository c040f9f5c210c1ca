"""Quiet by default: what the libraries print that Spindle knows to be harmless is filtered at its source.

Every command runs with diffusers' and transformers' loggers at `error`, their progress bars (component
loading, weight loading, shard writing: Spindle prints its own progress) off, and the warnings below
ignored. `--verbose` on any command leaves all of it as the libraries set it. Environment variables are
set too, so torchrun workers and subprocesses inherit the setting; a user's own setting of them wins.

Each filtered warning, and why it is harmless here:
- diffusers' "Accessing config attribute ... directly via ... object attribute is deprecated": raised by
  diffusers' own pipeline code (e.g. `WanPipeline` reading `self.boundary_ratio`), not by Spindle's.
- torch's "torch.meshgrid: in an upcoming release, it will be required to pass the indexing argument":
  called inside diffusers' rotary embeddings, which pass the default on purpose.
- torch's "`torch.jit.script_method` is deprecated": triggered at import by a dependency's module.
- FSDP2's "returned a view tensor": Spindle's tasks only read the prediction (out-of-place losses), so
  the pre-backward hook it warns about is never dropped.
"""

from __future__ import annotations

import os
import sys
import warnings

HARMLESS_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"Accessing config attribute .* directly via .* object attribute is deprecated", FutureWarning),
    (r"torch\.meshgrid: in an upcoming release, it will be required to pass the indexing argument", UserWarning),
    (r"`torch\.jit\.script_method` is deprecated", DeprecationWarning),
    (r"FSDP2-wrapped module .* returned a view tensor", UserWarning),
)
LIBRARY_SETTINGS = {
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' progress bars follow the hub's switch
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}


def quiet_libraries(loads_models: bool = True) -> None:
    """Filter the known-harmless output of the libraries (before or after they are imported).
    `loads_models`: the command will import diffusers anyway, so its own progress-bar switch (it reads no
    environment variable) is set now; commands that load no model skip that import."""
    for name, value in LIBRARY_SETTINGS.items():
        os.environ.setdefault(name, value)
    for pattern, category in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    # already imported (in-process callers), or about to be: apply the settings through their own switches
    if loads_models or "diffusers" in sys.modules:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_error()
        diffusers_logging.disable_progress_bar()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
