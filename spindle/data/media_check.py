"""A media dataset checked up front: every sample decoded once, before the first training step.

Finding a corrupt file after step 1, or one missing caption per run, costs a run each time; this
scan lists every unusable sample in one report (file names and what is wrong). A sample is usable
when its caption is present and non-empty (checked while listing, `spindle.data.datasets`) and its
media decodes at the job's resolution and frame count (what `read_media` does during training, so a
sample that passes here trains).

The result is cached per dataset (a JSON file under the user's cache folder), keyed on the sample
list (paths, sizes, modification times, captions) and the decode settings: a large dataset is
scanned once, and again only when a file or a setting changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spindle.contracts.condition import AudioTrack
from spindle.data.audio import read_audio_track
from spindle.data.media import MediaError, read_media

CACHE_ENV = "SPINDLE_CACHE_DIR"


@dataclass(frozen=True)
class Problem:
    path: Path
    reason: str

    def line(self) -> str:
        return f"{self.path}: {self.reason}"


class DataCheckError(ValueError):
    """Some samples are unusable: the message lists each (file and reason) and the fixes."""

    def __init__(self, source: Path, problems: Sequence[Problem], total: int):
        self.problems = list(problems)
        shown = "\n  ".join(p.line() for p in self.problems)
        super().__init__(
            f"data.path={source}: {len(self.problems)} of {total} sample(s) cannot be used:\n  {shown}\n"
            "Fix or remove these files, or set data.skip_bad_samples=true to train on the others."
        )


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spindle"
    return Path(root) / "data-checks"


def _files(sample: Any) -> list[Path]:
    """The files a sample reads: its media, its conditioning image when it names one (image-to-video),
    an edit pair's source images."""
    image = getattr(sample, "image", None)
    return [sample.path, *([] if image is None else [image]), *getattr(sample, "sources", ())]


def _stat(path: Path) -> list[Any]:
    try:
        st = path.stat()
        return [str(path), st.st_size, st.st_mtime_ns]
    except OSError:
        return [str(path), None, None]


def _fingerprint(samples: Sequence[Any], settings: dict[str, Any]) -> str:
    entries = [[*(x for f in _files(s) for x in _stat(f)), s.caption] for s in samples]
    blob = json.dumps({"samples": entries, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _problem(sample: Any, resolution: tuple[int, int], num_frames: int, audio: AudioTrack | None) -> str | None:
    try:
        read_media(sample.path, num_frames, resolution)
        if audio is not None:  # data.audio: the clip's soundtrack, read as the loader will
            read_audio_track(sample.path, audio, num_frames)
        image = getattr(sample, "image", None)
        if image is not None:  # the conditioning image, decoded as the loader will (one frame)
            read_media(image, 1, resolution)
    except MediaError as e:
        return e.problem if e.path == sample.path else f"conditioning image {e.path}: {e.problem}"
    for source in getattr(sample, "sources", ()):  # an edit pair's sources, decoded as the loader will
        try:
            read_media(source, 1, resolution)
        except MediaError as e:
            where = f" ({sample.where})" if getattr(sample, "where", "") else ""  # manifest:line
            return f"source image {e.path}{where}: {e.problem}"
    return None


def _read_cache(path: Path) -> dict[int, str] | None:
    try:
        record = json.loads(path.read_text())
        return {int(k): str(v) for k, v in record["bad"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: scan again


def _write_cache(path: Path, bad: dict[int, str]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # ranks scanning together never share a file
        tmp.write_text(json.dumps({"bad": {str(k): v for k, v in bad.items()}}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next run a rescan


def find_problems(
    samples: Sequence[Any], resolution: tuple[int, int], num_frames: int, audio: AudioTrack | None = None
) -> dict[int, str]:
    """{sample index: what is wrong} for the unusable samples, from the cache when nothing changed. `audio`
    (`data.audio`): each clip's soundtrack is checked too."""
    settings: dict[str, Any] = {"resolution": list(resolution), "num_frames": num_frames, "version": 2}
    if audio is not None:
        settings["audio"] = [audio.sample_rate, audio.channels, audio.frame_rate]
    cache = cache_dir() / f"{_fingerprint(samples, settings)}.json"
    bad = _read_cache(cache)
    if bad is None:
        bad = {}
        for index, sample in enumerate(samples):
            if (reason := _problem(sample, resolution, num_frames, audio)) is not None:
                bad[index] = reason
        _write_cache(cache, bad)
    return bad
