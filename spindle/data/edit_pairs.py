"""Edit pairs: a target image to learn (the edited image) and the source image(s) it is conditioned on.

Image-editing families (FLUX.1 Kontext, Qwen-Image-Edit) train on before/after pairs with an
instruction. Two layouts, both read into `spindle.data.datasets.Sample`s whose `path` is the target
(the training media, `"pixels"`) and whose `sources` are the conditioning images (`"images"`):

- a JSONL manifest, one pair per line, paths relative to the manifest's folder:
  `{"image": "src.png", "target": "edited.png", "caption": "make it blue"}`, or several sources
  `{"image": ["a.png", "b.png"], "target": ..., "caption": ...}`;
- a target folder (`data.path`: images + same-stem `.txt` captions, as any image dataset) with a
  control folder (`data.control_dir`) mirroring it, musubi-tuner's layout: the control image of
  `cats/cat1.png` is `cats/cat1.<any image extension>` under the control folder, or, for several,
  `cats/cat1_0.png`, `cats/cat1_1.png`, ... (any number of digits, `cat1_0000.png`), ordered by that
  number, the unnumbered one first.

Every source is resized and center-cropped to the sample's resolution exactly as the target is, in
the same value range: a sample holds `"images"` [N, 3, H, W] in [-1, 1], the batch `"images"`
[B, N, 3, H, W]. The condition model re-encodes them the way its pipeline encodes a user's image.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from spindle.data.media import IMAGE_EXTENSIONS, MediaError, is_image_path, read_media
from spindle.data.media_check import Problem

# `stem_0.png`, `stem_0001.png`: one of several control images of the target `stem`
_NUMBERED = re.compile(r"^(?P<stem>.+)_(?P<number>\d+)$")


def resolve(manifest: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else manifest.parent / path


def _image_path(path: Path, key: str, where: str) -> Path:
    if not is_image_path(path):
        raise MediaError(
            path,
            f"{key!r} must be an image file; unsupported extension {path.suffix!r} ({where})",
            f"Supported: {', '.join(sorted(IMAGE_EXTENSIONS))}.",
        )
    return path


def manifest_entry(manifest: Path, lineno: int, entry: dict[str, Any]) -> dict[str, Any]:
    """One edit-pair manifest line (an object with "target") -> the `Sample` fields: path (the target),
    caption, sources, where ("manifest:line", for errors about its files)."""
    where = f"{manifest}, line {lineno}"
    if "path" in entry:
        raise ValueError(
            f'{where}: give "target" (an edit pair: "image" = the source(s), "target" = the edited image) or '
            f'"path" (a captioned media file), not both'
        )
    for key in ("target", "caption", "image"):
        if key not in entry:
            other = '; a captioned media file needs "path" and "caption"' if key == "target" else ""
            raise ValueError(
                f'{where}: missing key {key!r} (an edit pair needs "image": the source image or a list of them, '
                f'"target": the edited image, "caption": the instruction{other})'
            )
    for key in ("target", "caption"):
        if not isinstance(entry[key], str):
            raise ValueError(f"{where}: {key!r} must be a string; got {type(entry[key]).__name__}")
    images = entry["image"]
    images = [images] if isinstance(images, str) else images
    if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
        raise ValueError(
            f"{where}: 'image' must be a source image path or a non-empty list of them; got {entry['image']!r}"
        )
    target = _image_path(resolve(manifest, entry["target"]), "target", where)
    sources = tuple(_image_path(resolve(manifest, i), "image", where) for i in images)
    return {"path": target, "caption": entry["caption"].strip(), "sources": sources, "where": f"{manifest}:{lineno}"}


def control_images(target: Path, target_root: Path, control_root: Path, target_stems: set[str]) -> list[Path]:
    """The control images of `target` (under `target_root`) in `control_root`, musubi-tuner's convention:
    the same relative folder and stem with any image extension, then `stem_<n>` numbered ones by n. A
    numbered name that is itself a target's stem (`cat_1.png` next to `cat.png`) belongs to that target."""
    folder = control_root / target.parent.relative_to(target_root)
    if not folder.is_dir():
        return []
    stem = target.stem
    found: list[tuple[int, str, Path]] = []
    for path in folder.iterdir():
        if not path.is_file() or not is_image_path(path) or path.name.startswith("."):
            continue
        if path.stem == stem:
            found.append((-1, path.name, path))
            continue
        m = _NUMBERED.match(path.stem)
        if m and m.group("stem") == stem and path.stem not in target_stems:
            found.append((int(m.group("number")), path.name, path))
    return [p for _, _, p in sorted(found)]


def attach_controls(samples: Sequence[Any], target_root: Path, control_root: Path) -> tuple[list[Any], list[Problem]]:
    """(samples with their control images as `sources`, problems): a target with no control image is a
    `media_check.Problem` naming it and where its control was looked for (`data.control_dir`)."""
    import dataclasses

    if not control_root.is_dir():
        raise FileNotFoundError(f"data.control_dir={control_root} is not a folder (the control images of data.path)")
    out, problems = [], []
    by_folder: dict[Path, set[str]] = {}
    for s in samples:
        by_folder.setdefault(s.path.parent, set()).add(s.path.stem)
    for sample in samples:
        controls = control_images(sample.path, target_root, control_root, by_folder[sample.path.parent])
        if not controls:
            rel = sample.path.relative_to(target_root).with_suffix("")
            problems.append(
                Problem(
                    sample.path,
                    f"no control image in data.control_dir (looked for {control_root / rel}.png or "
                    f"{control_root / rel}_0.png, any image extension)",
                )
            )
            continue
        out.append(dataclasses.replace(sample, sources=tuple(controls)))
    return out, problems


def read_sources(sample: Any, resolution: tuple[int, int]) -> torch.Tensor:
    """A sample's source images [N, 3, H, W] in [-1, 1], each resized and center-cropped to `resolution`
    as the target is."""
    return torch.stack([read_media(p, 1, resolution)[:, 0] for p in sample.sources])


def collate_sources(samples: list[dict[str, Any]]) -> torch.Tensor:
    """Per-sample "images" [N, 3, H, W] -> [B, N, 3, H, W]; every sample of a batch must have the same N."""
    counts = [s["images"].shape[0] if "images" in s else 0 for s in samples]
    if len(set(counts)) > 1:
        indices = [int(s["index"]) for s in samples]
        raise ValueError(
            f"cannot batch samples {indices} with {counts} source images: every sample of a micro-batch needs "
            f"the same number of source images; set train.micro_batch_size: 1, or give every pair as many sources"
        )
    return torch.stack([s["images"] for s in samples])
