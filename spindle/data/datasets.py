"""Caption + media datasets from a folder or a JSONL manifest.

Folder layout: media files anywhere below the folder, each with its caption in a same-name `.txt`
next to it (`clips/cat.mp4` + `clips/cat.txt`). Manifest layout: one JSON object per line,
`{"path": "clips/cat.mp4", "caption": "a cat"}` (+ optional `"image": "frames/cat.png"`, the sample's
conditioning image for image-to-video families), with relative paths resolved against the manifest's
folder (so a dataset folder can be moved or mounted elsewhere). Edit pairs (a target image and its
source image(s), `{"image": ..., "target": ..., "caption": ...}` lines or a folder with
`data.control_dir`) are parsed by `spindle.data.edit_pairs`.

Samples are listed in a sorted, deterministic order: every data-parallel rank builds the same list,
which the loader's shared permutation relies on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from spindle.contracts.condition import AudioTrack
from spindle.contracts.request import short_repr
from spindle.data.audio import read_audio_track
from spindle.data.captions import CaptionPolicy
from spindle.data.edit_pairs import attach_controls, collate_sources, manifest_entry, read_sources
from spindle.data.index import ShardedManifest, is_shard_folder
from spindle.data.media import IMAGE_EXTENSIONS, MEDIA_EXTENSIONS, MediaError, is_image_path, is_media_path, read_media
from spindle.data.media_check import DataCheckError, Problem, find_problems
from spindle.data.sources import of_kind
from spindle.data.text import decode_line

if TYPE_CHECKING:
    from spindle.data.buckets import BucketPlan

logger = logging.getLogger(__name__)
# a dataset up to this many samples is decoded once up front (spindle.data.media_check); a larger one
# (a lazy manifest index of millions of lines) is checked as it is read, under data.skip_bad_samples
CHECK_LIMIT = 100_000


@dataclass(frozen=True)
class Sample:
    path: Path
    caption: str
    image: Path | None = None  # a conditioning image (image-conditioned families; default: the first frame)
    # every caption of the sample when it has several (a manifest's "caption" list; one drawn per epoch,
    # spindle.data.captions), else empty: `caption` is the first
    captions: tuple[str, ...] = ()
    size: tuple[int, int, int] | None = None  # (frames, height, width) as the manifest declares it (buckets)
    sources: tuple[Path, ...] = ()  # an edit pair's source images (`path` is the target; spindle.data.edit_pairs)
    where: str = ""  # "manifest:line" of a manifest entry, for errors about its files
    last_image: Path | None = None  # the last frame's conditioning image (first-last-frame video, Wan FLF2V)


class MediaDataset(Dataset):
    """Decodes samples on access: {"pixels": [3, F, H, W] in [-1, 1], "caption": str, "index": int}
    (+ "image" [3, H, W]: an I2V conditioning image; + "images" [N, 3, H, W]: an edit pair's sources;
    + "audio" [channels, samples]: the clip's soundtrack, with `audio` set: `data.audio`).

    F is `num_frames` for videos and 1 for images. `index` is the index of the sample actually
    returned, which differs from the requested one only when a bad sample was skipped.

    With `skip_bad_samples`, a sample that fails to decode is logged once, remembered (so it is not
    decoded again) and replaced by the next good one (i+1, i+2, ... modulo len): deterministic, so
    every run and every resume sees the same substitution. `num_skipped` counts the distinct bad
    files seen by this process (with loader workers, each worker keeps its own count).
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        resolution: tuple[int, int],
        num_frames: int,
        skip_bad_samples: bool = False,
    ):
        if not samples:
            raise ValueError("MediaDataset needs at least one sample")
        if num_frames <= 0:
            raise ValueError(f"num_frames must be positive; got {num_frames}")
        # a lazy sequence (spindle.data.index) stays lazy
        self.samples: Sequence[Sample] = samples if isinstance(samples, Sequence) else list(samples)
        self.resolution = (int(resolution[0]), int(resolution[1]))
        self.num_frames = int(num_frames)
        self.skip_bad_samples = skip_bad_samples
        self._bad: set[int] = set()
        # data.buckets: each sample's (frames, height, width) (spindle.data.buckets); None: one shape for all
        self.plan: BucketPlan | None = None
        self.captions = CaptionPolicy()  # caption dropout / prefix / one of several (spindle.data.captions)
        self.epoch = 0  # set by the loader at each epoch's start: per-epoch caption draws
        # files `build_dataset` left out before training (data.skip_bad_samples), for the run summary
        self.skipped_files: list[Path] = []
        self.audio: AudioTrack | None = None  # data.audio: each clip's soundtrack in this format (spindle.data.audio)

    @property
    def num_skipped(self) -> int:
        return len(self._bad)

    def __len__(self) -> int:
        return len(self.samples)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def shape(self, index: int) -> tuple[int, tuple[int, int]]:
        """(frames, (height, width)) sample `index` is decoded at: its bucket's, or the configured one."""
        if self.plan is None:
            return self.num_frames, self.resolution
        frames, height, width = self.plan.shape(index)
        return frames, (height, width)

    def load(self, index: int) -> dict[str, Any]:
        """Decode one sample with no skipping (raises MediaError for a bad file)."""
        sample = self.samples[index]
        frames, resolution = self.shape(index)
        pixels = read_media(sample.path, frames, resolution)
        caption = sample.caption
        if self.captions.active or sample.captions:
            caption = self.captions.choose(sample.captions or (sample.caption,), self.epoch, index)
        out = {"pixels": pixels, "caption": caption, "index": index}
        if sample.image is not None:  # resized and cropped as the clip's frames are: [3, H, W]
            out["image"] = read_media(sample.image, 1, resolution)[:, 0]
        if sample.sources:  # an edit pair's source images, decoded as the target is
            out["images"] = read_sources(sample, resolution)
        if sample.last_image is not None:
            out["last_image"] = read_media(sample.last_image, 1, resolution)[:, 0]
        if self.audio is not None:
            out["audio"] = read_audio_track(sample.path, self.audio, frames)
        return out

    def same_shape(self, a: int, b: int) -> bool:
        return self.plan is None or self.plan.ids[a] == self.plan.ids[b]

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = len(self.samples)
        if not -n <= index < n:
            raise IndexError(f"sample index {index} out of range for a dataset of {n}")
        index %= n
        if not self.skip_bad_samples:
            return self.load(index)
        for offset in range(n):
            candidate = (index + offset) % n
            if candidate in self._bad or not self.same_shape(candidate, index):  # a substitute from its bucket
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
    """Stack samples into {"pixels": [B, 3, F, H, W], "caption": list[str], "index": [B]} (+ "image"
    [B, 3, H, W], + "images" [B, N, 3, H, W] for edit pairs: every sample with the same N)."""
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
    if any("images" in s for s in samples):
        batch["images"] = collate_sources(samples)
    last = [s["index"] for s in samples if "last_image" in s]
    if last and len(last) != len(samples):  # a first-last-frame model conditions every video of a batch alike
        raise ValueError(
            f"cannot batch samples {[s['index'] for s in samples]}: only {last} name a 'last_image'; give every "
            "manifest entry a last_image (or none), or use micro_batch_size=1"
        )
    if last:
        batch["last_image"] = torch.stack([s["last_image"] for s in samples])
    if "audio" in samples[0]:  # data.audio: every clip has its soundtrack, of its (shared) frame count's length
        batch["audio"] = torch.stack([s["audio"] for s in samples])
    return batch


# ----------------------------------------------------------------------------- listing


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def list_folder(folder: str | os.PathLike[str], kind: str = "both") -> tuple[list[Sample], list[Problem]]:
    """Media files below `folder` (recursive, sorted, hidden entries ignored; only videos or images with
    `kind`) with their captions, and the media files whose caption file is missing or empty (named by
    that caption file)."""
    folder = Path(folder)
    media = sorted(
        (
            p
            for p in folder.rglob("*")
            if p.is_file() and is_media_path(p) and of_kind(p, kind) and not _is_hidden(p, folder)
        ),
        key=lambda p: p.relative_to(folder).as_posix(),
    )
    samples, problems = [], []
    for path in media:
        caption_file = path.with_suffix(".txt")
        if not caption_file.is_file():
            problems.append(Problem(caption_file, f"caption file missing for {path.name}"))
            continue
        try:
            caption = decode_line(caption_file.read_bytes()).strip()
        except ValueError as e:  # a bad sample like an empty caption: named, skippable
            problems.append(Problem(caption_file, f"caption of {path.name} {e}"))
            continue
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
    if "target" in entry or ("image" in entry and "path" not in entry):  # an edit pair
        return Sample(**manifest_entry(manifest, lineno, entry))
    for key in ("path", "caption"):
        if key not in entry:
            raise ValueError(f'{where}: missing key {key!r} (each line needs "path" and "caption")')
    if not isinstance(entry["path"], str):
        raise ValueError(f"{where}: 'path' must be a string; got {type(entry['path']).__name__}")
    captions = entry["caption"] if isinstance(entry["caption"], list) else [entry["caption"]]
    if not captions or not all(isinstance(c, str) for c in captions):
        raise ValueError(
            f"{where}: 'caption' must be a string or a non-empty list of strings (one drawn per epoch); "
            f"got {short_repr(entry['caption'])}"
        )
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
    stripped = tuple(c.strip() for c in captions)
    several = stripped if len(stripped) > 1 and all(stripped) else ()
    caption = "" if not all(stripped) else stripped[0]
    return Sample(path, caption, image, several, declared_size(entry, where), last_image=last_image)


def declared_size(entry: dict[str, Any], where: str) -> tuple[int, int, int] | None:
    """A line's optional media size: "width" and "height" (+ "frames" for a video), positive integers."""
    keys = [k for k in ("frames", "height", "width") if k in entry]
    if not keys:
        return None
    values = {k: entry[k] for k in keys}
    if not {"height", "width"} <= set(keys) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values.values()
    ):
        raise ValueError(
            f'{where}: a declared size needs positive integers "height" and "width" (and "frames" for a video); '
            f"got {values}"
        )
    return (values.get("frames", 1), values["height"], values["width"])


def open_manifest(path: str | os.PathLike[str]) -> ShardedManifest:
    """A .jsonl manifest or a folder of .jsonl shards as a lazy, checked index (`spindle.data.index`)."""
    return ShardedManifest.open(path, _manifest_entry)


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
    with manifest.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = decode_line(raw)
            except ValueError as e:
                raise ValueError(f"{manifest}, line {lineno}: {e}") from None
            if line.strip():
                samples.append(_manifest_entry(manifest, lineno, line))
    return samples


def _check_files_exist(samples: Sequence[Sample], source: Path) -> None:
    missing = [p for s in samples for p in (s.path, s.image, *s.sources) if p is not None and not p.is_file()]
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
    kind: str = "both",
    control_dir: str | os.PathLike[str] | None = None,
    audio: AudioTrack | None = None,
) -> MediaDataset:
    """A MediaDataset from a folder (captions in same-name .txt files), a .jsonl manifest or a folder of
    .jsonl shards (both indexed lazily, `spindle.data.index`).

    Everything is checked here, at start-up, rather than hours into training: listing errors (missing
    folder, bad manifest line) raise at once; with `check`, every sample is decoded once
    (`spindle.data.media_check`, cached; datasets of up to CHECK_LIMIT samples) and every unusable one
    (missing or empty caption, missing, corrupt or undecodable file) is listed in one DataCheckError, or,
    with `skip_bad_samples`, left out, counted (`skipped_files`) and, with `warn_skipped`, named in one
    warning. Without `check` (training on precomputed conditions, whose media is not decoded) only the
    listing is checked. `kind` (a `data.sources` entry's): `video` or `image` keeps only those files (a
    manifest line of the other kind is an error), `both` keeps all. `audio` (`data.audio`): each clip's
    soundtrack is read too, and checked with it.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"dataset path {path} does not exist (set data.path to a folder or a .jsonl manifest)")
    if control_dir is not None and not path.is_dir():
        raise ValueError(
            f"data.control_dir is for a folder data.path; {path} is a manifest: give each line its source "
            f'images ("image") and remove data.control_dir'
        )
    samples: Sequence[Sample]
    if (path.is_file() and path.suffix.lower() == ".jsonl") or is_shard_folder(path):
        index = _of_kind(open_manifest(path), kind, path)
        samples, problems = index, list(index.problems)
        if not check and not skip_bad_samples and len(index) <= CHECK_LIMIT:
            _check_files_exist(index, path)
    elif path.is_dir():
        samples, problems = list_folder(path, kind)
        if control_dir is not None:  # edit pairs: data.path holds the targets
            samples, missing = attach_controls(samples, path, Path(control_dir).expanduser())
            problems += missing
    else:
        raise ValueError(f"dataset path {path} must be a folder, a .jsonl manifest or a folder of .jsonl shards")
    total = len(samples) + len(problems)
    if not total:
        raise ValueError(f"dataset {path} has no samples (media extensions: {', '.join(sorted(MEDIA_EXTENSIONS))})")
    if check and len(samples) <= CHECK_LIMIT:
        bad = find_problems(samples, resolution, num_frames, audio)
        problems += [Problem(samples[i].path, reason) for i, reason in sorted(bad.items())]
        samples = _without(samples, set(bad))
    elif check:
        logger.info("%s: %d samples, too many to decode up front; each is checked as it is read", path, len(samples))
    if problems and not skip_bad_samples:
        raise DataCheckError(path, sorted(problems, key=lambda p: str(p.path)), total)
    if not samples:
        raise DataCheckError(path, problems, total)  # skipping every sample leaves nothing to train on
    if problems and warn_skipped:
        shown = ", ".join(p.path.name for p in problems[:5]) + (" ..." if len(problems) > 5 else "")
        logger.warning("data.skip_bad_samples: skipping %d of %d samples (%s)", len(problems), total, shown)
    dataset = MediaDataset(samples, resolution, num_frames, skip_bad_samples=skip_bad_samples)
    dataset.skipped_files = [p.path for p in problems]
    dataset.audio = audio
    return dataset


def _without(samples: Sequence[Sample], bad: set[int]) -> Sequence[Sample]:
    if isinstance(samples, ShardedManifest):
        return samples.subset(np.asarray([i not in bad for i in range(len(samples))], dtype=bool))
    return [s for i, s in enumerate(samples) if i not in bad]


def _of_kind(index: ShardedManifest, kind: str, source: Path) -> ShardedManifest:
    """A manifest's samples, all of `kind` (a `data.sources` entry's); a line of another kind is an error."""
    if kind == "both":
        return index
    wrong = np.flatnonzero(index.videos != (kind == "video"))
    if len(wrong):
        first = index.read(int(wrong[0]))
        raise MediaError(
            first.path,
            f"{len(wrong)} line(s) of {source} are not {kind} files, but the source's kind is {kind!r} "
            f"(first: line {int(index.lines[wrong[0]])})",
            "Set the source's kind to both, or list those files in a source of their own.",
        )
    return index
