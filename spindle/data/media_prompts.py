"""Prompts for an online DiT objective (`train.objective: flow_grpo`): what the rollouts generate from.

`data.path` is a JSONL file, one prompt per line; image paths are relative to the file's folder:

    {"prompt": "a red fox in snow"}
    {"prompt": "she turns her head", "image": "first.png", "style": "noir"}

`image` is the conditioning image of an image-to-video or edit family (a path, or a list of paths for a request
that takes several, e.g. a first-last-frame checkpoint: required there, refused for a text-only family). Every
other key is an extra column passed to the rewards by name, one value per sample (`docs/post-training-dit.md`).
Checked before any model is built: every bad line is named as `file:line` in one error, and every conditioning
image is opened once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spindle.contracts.images import request_images
from spindle.contracts.request import RequestError
from spindle.data.edit_pairs import resolve
from spindle.data.text import bad_lines_message, json_object_line

# the keyword a reward function receives the generated samples and the prompts under: not column names
RESERVED_COLUMNS = ("images", "prompts")


class PromptsError(ValueError):
    """The prompts file is unusable; the message names every bad line."""


@dataclass(frozen=True)
class MediaPrompt:
    """One prompt line: the text, its conditioning images (resolved paths; none for text-only families), the
    extra columns for the rewards, and where it came from (`file:line`)."""

    prompt: str
    images: tuple[Path, ...] = ()
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""


def _prompt(path: Path, lineno: int, line: bytes) -> MediaPrompt:
    where = f"{path}:{lineno}"
    entry = json_object_line(where, line, '{"prompt": "..."}')  # the text data's reader: not UTF-8, not JSON
    prompt = entry.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    reserved = [k for k in RESERVED_COLUMNS if k in entry]
    if reserved:
        raise ValueError(f"{where}: column {reserved[0]!r} is the argument rewards get the {reserved[0]} as; rename it")
    image = entry.get("image")
    paths = [image] if isinstance(image, str) else image if isinstance(image, list) else None
    if image is not None and (not paths or not all(isinstance(p, str) and p.strip() for p in paths)):
        raise ValueError(f"{where}: 'image' (the conditioning image) must be a path string or a list of them")
    images = tuple(resolve(path, p) for p in paths or [])
    columns = {k: v for k, v in entry.items() if k not in ("prompt", "image")}
    return MediaPrompt(prompt, images, columns, where)


def read_media_prompts(data_path: str | Path, images: tuple[int, int], family: str) -> list[MediaPrompt]:
    """The prompts of the JSONL file at `data_path`, checked: every line parses, each holds `images` = (least,
    most) conditioning images (what `family`'s requests take: `contracts/images.request_images`, the rule generate
    and the server apply), and every image decodes. One error lists every problem (up to 20)."""
    path = Path(data_path).expanduser()
    if not path.is_file() or path.suffix.lower() != ".jsonl":
        raise PromptsError(
            f'data.path={path} must be a prompts .jsonl file (one {{"prompt": ...}} object per line; '
            "docs/post-training-dit.md)"
        )
    prompts, errors = [], []
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):  # one bad byte: one bad line, not a crash
        if not line.strip():
            continue
        try:
            row = _prompt(path, lineno, line)
        except ValueError as e:
            errors.append(str(e))
            continue
        try:  # the requests' image rule (count, then each file read), as generate and the server apply it
            request_images(list(row.images) or None, None, images, family, names=(f"{row.where}: 'image'", ""))
        except RequestError as e:
            errors.append(str(e))
            continue
        prompts.append(row)
    if errors:
        raise PromptsError(bad_lines_message(path, errors))
    if not prompts:
        raise PromptsError(f"data.path={path} holds no prompts")
    return prompts
