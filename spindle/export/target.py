"""Where an export may be written, checked before any work: an export replaces its `--out` folder, so
that folder must be absent, empty, or an earlier Spindle export (its `spindle.json` record at the top),
and never the run, the checkpoint or the base model being read (nor a folder holding them).

The writers build the export in a temporary sibling (`<out>.tmp`, `<out>.ema.tmp`) and rename it over
`out`; those siblings must not hold anything either (a folder left by an export that was killed is
named, for the user to remove). A disk that fills up during the export is one line naming the folder
and about how many bytes it needs, and the temporaries are removed (`export_failed`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spindle.distributed.integrity import DiskFullError, is_disk_full
from spindle.export.record import EXPORT_RECORD

# the temporary siblings of `out` the export writers use (`<out>.tmp`; `<out>.ema.tmp` for export.weights both)
TEMPORARY_SUFFIXES = (".tmp", ".ema.tmp")


class ExportTargetError(ValueError):
    """An `--out` an export may not write to; the message names the folder and the fix."""


def temporaries(out: Path) -> list[Path]:
    return [out.with_name(out.name + suffix) for suffix in TEMPORARY_SUFFIXES]


def is_spindle_export(folder: Path) -> bool:
    """True when `folder` has Spindle's export record (`spindle.json`, a JSON object) at its top."""
    try:
        return isinstance(json.loads((folder / EXPORT_RECORD).read_text()), dict)
    except (OSError, ValueError):
        return False


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def refuse_protected(
    out: Path, protected: Mapping[str, str | Path | None], fix: str = "choose a new --out folder"
) -> None:
    """Refuse an `out` that is, or holds, one of `protected` ({what it is: path}: the folders the export
    reads), symlinks resolved. The end-of-run export (`<output_dir>/export`, inside the run's own locked
    folder) checks only this: what else is in that folder is the run's own."""
    real = Path(os.path.realpath(out))
    for what, path in protected.items():
        if path is None:
            continue
        held = Path(os.path.realpath(path))
        if _within(held, real):
            same = "is" if held == real else "holds"
            raise ExportTargetError(
                f"export folder {out} {same} the {what} ({path}): an export replaces its folder; {fix}"
            )


def check_export_target(
    out: str | Path,
    protected: Mapping[str, str | Path | None],
    force: bool,
    managed: Mapping[str, str | Path | None] | None = None,
) -> Path:
    """Refuse (ExportTargetError) an `out` that `spindle export` may not replace; -> `out` as given.

    `protected`: {what it is: path} of the folders the export reads (the run, the checkpoint, the base
    model): `out` may be none of them nor hold one. `managed`: folders whose content Spindle deletes on
    its own (a run's checkpoints, pruned by `checkpoint.keep_last`): `out` may not be inside one either.
    `force`: replace an earlier Spindle export (without it, an existing export is refused too, so a typo
    never replaces one)."""
    out = Path(out)
    refuse_protected(out, protected)
    real = Path(os.path.realpath(out))
    for what, path in (managed or {}).items():
        if path is not None and _within(real, Path(os.path.realpath(path))):
            raise ExportTargetError(
                f"--out {out} is inside the {what} ({path}), whose folders Spindle removes as it prunes; "
                "choose a folder outside it"
            )
    if out.exists() and not out.is_dir():
        raise ExportTargetError(f"--out {out} is a file, not a folder; choose a new folder")
    if out.is_dir() and any(out.iterdir()):
        if not is_spindle_export(out):
            raise ExportTargetError(
                f"--out {out} is not empty and is not an earlier Spindle export (no {EXPORT_RECORD}); an export "
                "replaces its --out folder: choose a new or empty folder"
            )
        if not force:
            raise ExportTargetError(
                f"--out {out} holds an earlier export; pass --force to replace it, or choose a new folder"
            )
    for tmp in temporaries(out):
        if tmp.exists() or tmp.is_symlink():
            raise ExportTargetError(
                f"{tmp} exists (an export writes there first; one that was killed leaves it behind): remove it "
                "or choose another --out"
            )
    return out


def record_export(out: Path, **facts: Any) -> None:
    """Give a finished export its top-level record where its writer left none (a transformers folder, a
    LoRA export's `lora/` + `merged/`), so a later export recognises it (`is_spindle_export`)."""
    if out.is_dir() and not (out / EXPORT_RECORD).exists():
        (out / EXPORT_RECORD).write_text(json.dumps(facts, indent=2) + "\n")


def folder_bytes(folder: str | Path) -> int:
    """The total size of the files under `folder`."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
            except OSError:
                continue  # vanished meanwhile: not part of the size
    return total


def export_failed(error: BaseException, out: Path, needed: int) -> BaseException:
    """What to raise for an export to `out` that failed with `error`: its temporaries are removed (a
    partial export is never left filling the disk); a full disk becomes one `DiskFullError` line naming
    `out`, the `needed` bytes (an estimate) and the space free without the partial export."""
    for tmp in temporaries(out):
        shutil.rmtree(tmp, ignore_errors=True)
    if not is_disk_full(error):
        return error
    parent = out.parent if out.parent.exists() else Path(".")
    free = shutil.disk_usage(parent).free
    return DiskFullError(
        f"No space left on device while exporting to {out}: it needs about {needed} bytes ({needed / 2**20:.1f} "
        f"MiB), {free} are free there; the partial export was removed and the checkpoint is intact. Free space "
        "or choose another --out, then export again",
        out,
    )
