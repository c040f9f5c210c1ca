"""Caption + media datasets from a folder or a JSONL manifest.

Folder layout: media files anywhere below the folder, each with its caption in a same-name `.txt`
next to it (`clips/cat.mp4` + `clips/cat.txt`). Manifest layout: one JSON object per line,
`{"path": "clips/cat.mp4", "caption": "a cat"}` (+ optional `"image": "frames/cat.png"`, the sample's
conditioning image for image-to-video families), with relative paths resolved against the manifest's
folder (so a dataset folder can be moved or mounted elsewhere).

Samples are listed in a sorted, deterministic order: every data-parallel rank builds the same list,
which the loader's shared permutation relies on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from spindle.data.media import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, MediaError, is_image_path, is_media_path, read_media
from spindle.data.media_check import DataCheckError, Problem, find_problems

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    path: Path
    caption: str
    image: Path | None = None  # a conditioning image (image-conditioned families; default: the first frame)
    last_image: Path | None = None  # the last frame's conditioning image (first-last-frame video, Wan FLF2V)


class MediaDataset(Dataset):
    """Decodes samples on access: {"pixels": [3, F, H, W] in [-1, 1], "caption": str, "index": int}.

    F is `num_frames` for videos and 1 for images. `index` is the index of the sample actually
    returned, which differs from the requested one only when a bad sample was skipped.

    With `skip_bad_samples`, a sample that fails to decode is logged once, remembered (so it is not
    decoded again) and replaced by the next good one (i+1, i+2, ... modulo len): deterministic, so
    every run and every resume sees the same substitution. `num_skipped` counts the distinct bad
    files seen by this process (with loader workers, each worker keeps its own count).
    """

    def __init__(
        self,
        samples: list[Sample],
        resolution: tuple[int, int],
        num_frames: int,
        skip_bad_samples: bool = False,
    ):
        if not samples:
            raise ValueError("MediaDataset needs at least one sample")
        if num_frames <= 0:
            raise ValueError(f"num_frames must be positive; got {num_frames}")
        self.samples = list(samples)
        self.resolution = (int(resolution[0]), int(resolution[1]))
        self.num_frames = int(num_frames)
        self.skip_bad_samples = skip_bad_samples
        self._bad: set[int] = set()
        # files `build_dataset` left out before training (data.skip_bad_samples), for the run summary
        self.skipped_files: list[Path] = []

    @property
    def num_skipped(self) -> int:
        return len(self._bad)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> dict[str, Any]:
        """Decode one sample with no skipping (raises MediaError for a bad file)."""
        sample = self.samples[index]
        pixels = read_media(sample.path, self.num_frames, self.resolution)
        out = {"pixels": pixels, "caption": sample.caption, "index": index}
        if sample.image is not None:  # resized and cropped as the clip's frames are: [3, H, W]
            out["image"] = read_media(sample.image, 1, self.resolution)[:, 0]
        if sample.last_image is not None:
            out["last_image"] = read_media(sample.last_image, 1, self.resolution)[:, 0]
        return out

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.samples)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for a dataset of {n}")
        index %= n
        if not self.skip_bad_samples:
            return self.load(index)
        for offset in range(n):
            candidate = (index + offset) % n
            if candidate in self._bad:
                continue
            try:
                return self.load(candidate)
            except MediaError as exc:
                self._bad.add(candidate)
                logger.warning("skipping bad sample %d (%s); %d skipped so far", candidate, exc, len(self._bad))
        raise MediaError(
            self.samples[index].path,
            f"every one of the {n} samples in the dataset failed to load (this file included)",
            "Check the dataset: the files may all be corrupt or in an unsupported codec.",
        )


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack samples into {"pixels": [B, 3, F, H, W], "caption": list[str], "index": [B]}."""
    if not samples:
        raise ValueError("collate got an empty list of samples")
    shapes = {tuple(s["pixels"].shape) for s in samples}
    if len(shapes) > 1:
        frames = sorted({shape[1] for shape in shapes})
        detail = (
            f"frame counts {frames}: images (1 frame) and videos cannot share a batch"
            if len(frames) > 1
            else f"pixel shapes {sorted(shapes)}"
        )
        raise ValueError(
            f"cannot batch samples {[s['index'] for s in samples]} with different {detail}. "
            "Use micro_batch_size=1 or keep images and videos in separate datasets."
        )
    batch = {
        "pixels": torch.stack([s["pixels"] for s in samples]),
        "caption": [s["caption"] for s in samples],
        "index": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
    }
    if any("image" in s for s in samples):  # conditioning images; a sample without one conditions on its first frame
        batch["image"] = torch.stack([s["image"] if "image" in s else s["pixels"][:, 0] for s in samples])
    last = [s["index"] for s in samples if "last_image" in s]
    if last and len(last) != len(samples):  # a first-last-frame model conditions every video of a batch alike
        raise ValueError(
            f"cannot batch samples {[s['index'] for s in samples]}: only {last} name a 'last_image'; give every "
            "manifest entry a last_image (or none), or use micro_batch_size=1"
        )
    if last:
        batch["last_image"] = torch.stack([s["last_image"] for s in samples])
    return batch


# ----------------------------------------------------------------------------- listing


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def list_folder(folder: str | os.PathLike[str]) -> tuple[list[Sample], list[Problem]]:
    """Media files below `folder` (recursive, sorted, hidden entries ignored) with their captions, and
    the media files whose caption file is missing or empty (named by that caption file)."""
    folder = Path(folder)
    media = sorted(
        (p for p in folder.rglob("*") if p.is_file() and is_media_path(p) and not _is_hidden(p, folder)),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    samples, problems = [], []
    for path in media:
        caption_file = path.with_suffix(".txt")
        if not caption_file.is_file():
            problems.append(Problem(caption_file, f"caption file missing for {path.name}"))
            continue
        caption = caption_file.read_text(encoding="utf-8").strip()
        if not caption:
            problems.append(Problem(caption_file, f"empty caption for {path.name}"))
            continue
        samples.append(Sample(path, caption))
    return samples, problems


def scan_folder(folder: str | os.PathLike[str]) -> list[Sample]:
    """Media files below `folder` with their captions; a missing or empty caption is an error naming it."""
    samples, problems = list_folder(folder)
    if problems:
        raise MediaError(problems[0].path, problems[0].reason, "Write the caption into it, or remove the media file.")
    return samples


def _manifest_entry(manifest: Path, lineno: int, line: str) -> Sample:
    where = f"{manifest}, line {lineno}"
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(entry, dict):
        raise ValueError(f'{where}: expected an object like {{"path": ..., "caption": ...}}')
    for key in ("path", "caption"):
        if key not in entry:
            raise ValueError(f'{where}: missing key {key!r} (each line needs "path" and "caption")')
        if not isinstance(entry[key], str):
            raise ValueError(f"{where}: {key!r} must be a string; got {type(entry[key]).__name__}")
    path = Path(entry["path"]).expanduser()
    if not path.is_absolute():
        path = manifest.parent / path
    if not is_media_path(path):
        raise MediaError(
            path,
            f"unsupported extension {path.suffix!r} ({where})",
            f"Supported: {', '.join(sorted(MEDIA_EXTENSIONS))}.",
        )
    # optional: the sample's conditioning image (image-to-video) and last frame (first-last-frame video)
    image, last_image = (_entry_image(entry, key, manifest, where) for key in ("image", "last_image"))
    return Sample(path, entry["caption"].strip(), image, last_image)


def _entry_image(entry: dict[str, Any], key: str, manifest: Path, where: str) -> Path | None:
    """The image file a manifest entry names under `key` (relative to the manifest), or None."""
    if key not in entry:
        return None
    if not isinstance(entry[key], str):
        raise ValueError(f"{where}: '{key}' must be a string path; got {type(entry[key]).__name__}")
    image = Path(entry[key]).expanduser()
    if not image.is_absolute():
        image = manifest.parent / image
    if not is_image_path(image):
        raise MediaError(
            image,
            f"'{key}' must be an image file; unsupported extension {image.suffix!r} ({where})",
            f"Supported: {', '.join(sorted(IMAGE_EXTENSIONS))}.",
        )
    return image


def read_manifest(manifest: str | os.PathLike[str]) -> list[Sample]:
    """Samples from a JSONL manifest; blank lines are ignored, any other bad line is an error."""
    manifest = Path(manifest)
    samples = []
    with manifest.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                samples.append(_manifest_entry(manifest, lineno, line))
    return samples


def _check_files_exist(samples: list[Sample], source: Path) -> None:
    missing = [p for s in samples for p in (s.path, s.image) if p is not None and not p.is_file()]
    if missing:
        shown = ", ".join(str(p) for p in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise MediaError(
            missing[0],
            f"{len(missing)} file(s) listed in {source} do not exist: {shown}",
            "Fix the paths (relative paths are resolved against the manifest's folder), "
            "or set data.skip_bad_samples=true to skip them.",
        )


def build_dataset(
    path: str | os.PathLike[str],
    resolution: tuple[int, int],
    num_frames: int,
    skip_bad_samples: bool = False,
    check: bool = True,
    warn_skipped: bool = True,
) -> MediaDataset:
    """A MediaDataset from a folder (captions in same-name .txt files) or a .jsonl manifest.

    Everything is checked here, at start-up, rather than hours into training: listing errors (missing
    folder, bad manifest line) raise at once; with `check`, every sample is decoded once
    (`spindle.data.media_check`, cached) and every unusable one (missing or empty caption, missing,
    corrupt or undecodable file) is listed in one DataCheckError, or, with `skip_bad_samples`, left
    out, counted (`skipped_files`) and, with `warn_skipped`, named in one warning. Without `check`
    (training on precomputed conditions, whose media is not decoded) only the listing is checked.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset path {path} does not exist (set data.path to a folder or a .jsonl manifest)")
    if path.is_dir():
        samples, problems = list_folder(path)
    elif path.suffix.lower() == ".jsonl":
        listed = read_manifest(path)
        samples = [s for s in listed if s.caption]
        problems = [Problem(s.path, f"empty caption in {path.name}") for s in listed if not s.caption]
        if not check and not skip_bad_samples:
            _check_files_exist(samples, path)
    else:
        raise ValueError(f"dataset path {path} must be a folder or a .jsonl manifest")
    total = len(samples) + len(problems)
    if not total:
        raise ValueError(f"dataset {path} has no samples (media extensions: {', '.join(sorted(MEDIA_EXTENSIONS))})")
    if check:
        bad = find_problems(samples, resolution, num_frames)
        problems += [Problem(samples[i].path, reason) for i, reason in sorted(bad.items())]
        samples = [s for i, s in enumerate(samples) if i not in bad]
    if problems and not skip_bad_samples:
        raise DataCheckError(path, sorted(problems, key=lambda p: str(p.path)), total)
    if not samples:
        raise DataCheckError(path, problems, total)  # skipping every sample leaves nothing to train on
    if problems and warn_skipped:
        shown = ", ".join(p.path.name for p in problems[:5]) + (" ..." if len(problems) > 5 else "")
        logger.warning("data.skip_bad_samples: skipping %d of %d samples (%s)", len(problems), total, shown)
    dataset = MediaDataset(samples, resolution, num_frames, skip_bad_samples=skip_bad_samples)
    dataset.skipped_files = [p.path for p in problems]
    return dataset
