"""patchgen: generated, diff-reviewable patches of transformers modeling files (see docs/patchgen.md).

`spec` is the DSL a family's `patches.py` uses, `generator` applies it to the installed upstream
source, `check` finds configs and compares their outputs with the checked-in files.
"""

from spindle.patchgen.spec import Patch, PatchConfig, PatchgenError

__all__ = ["Patch", "PatchConfig", "PatchgenError"]
