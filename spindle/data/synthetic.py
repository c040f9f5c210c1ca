"""Synthetic caption datasets (moving coloured shapes) for tests and the demo.

The clips are real mp4 files written by `spindle.data.media.write_video`, with same-name `.txt`
captions built only from words the tiny test tokenizer knows (spindle/models/shared/tokenizers.py), so a
tiny model can actually learn the caption -> colour/shape/motion mapping. Everything is a pure
function of `seed`.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from spindle.data.datasets import scan_folder
from spindle.data.media import write_image, write_video

SHAPE_COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 30),
    "orange": (245, 140, 20),
    "purple": (130, 40, 170),
    "pink": (245, 130, 180),
    "cyan": (30, 200, 220),
    "magenta": (220, 40, 200),
    "brown": (120, 70, 30),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (15, 15, 15),
    "gray": (128, 128, 128),
}
SHAPES = ("circle", "square", "triangle")
# Unit motion per direction in image coordinates (x right, y down).
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}


def draw_shape(
    size: tuple[int, int],
    background: tuple[int, int, int],
    shape: str,
    colour: tuple[int, int, int],
    center: tuple[float, float],
    radius: float,
) -> np.ndarray:
    """One frame [H, W, 3] uint8 with `shape` of half-extent `radius` centred at (x, y)."""
    height, width = size
    img = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(img)
    x, y = center
    box = (x - radius, y - radius, x + radius, y + radius)
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([(x, y - radius), (x + radius, y + radius), (x - radius, y + radius)], fill=colour)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return np.asarray(img, dtype=np.uint8)


def _radius(size: tuple[int, int]) -> float:
    return max(3.0, min(size) / 6)


def _trajectory(
    size: tuple[int, int], direction: str, radius: float, num_frames: int, rng: random.Random
) -> list[tuple[float, float]]:
    """Centres moving edge to edge along `direction`, at a random offset across it."""
    height, width = size
    dx, dy = DIRECTIONS[direction]
    lo_x, hi_x = radius + 1, width - radius - 2
    lo_y, hi_y = radius + 1, height - radius - 2
    if dx:
        y = rng.uniform(lo_y, hi_y)
        xs = (lo_x, hi_x) if dx > 0 else (hi_x, lo_x)
        return [(xs[0] + (xs[1] - xs[0]) * t / max(1, num_frames - 1), y) for t in range(num_frames)]
    x = rng.uniform(lo_x, hi_x)
    ys = (lo_y, hi_y) if dy > 0 else (hi_y, lo_y)
    return [(x, ys[0] + (ys[1] - ys[0]) * t / max(1, num_frames - 1)) for t in range(num_frames)]


def _pick_colours(rng: random.Random) -> tuple[str, str]:
    return rng.choice(list(SHAPE_COLOURS)), rng.choice(list(BACKGROUNDS))


def make_shapes_video_dataset(
    out: str | Path,
    num_videos: int = 16,
    num_frames: int = 17,
    size: tuple[int, int] = (64, 64),
    fps: int = 8,
    seed: int = 0,
) -> Path:
    """Write `num_videos` mp4 clips (size = (height, width)) + captions like
    "a red circle moves left on a gray background" into `out`; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    # Cycle through every (shape, direction) pair in a seeded order so small sets still vary.
    combos = list(itertools.product(SHAPES, DIRECTIONS))
    rng.shuffle(combos)
    radius = _radius(size)
    for i in range(num_videos):
        shape, direction = combos[i % len(combos)]
        colour, background = _pick_colours(rng)
        centres = _trajectory(size, direction, radius, num_frames, rng)
        frames = np.stack(
            [draw_shape(size, BACKGROUNDS[background], shape, SHAPE_COLOURS[colour], c, radius) for c in centres]
        )
        write_video(out / f"clip_{i:03d}.mp4", frames, fps=fps)
        caption = f"a {colour} {shape} moves {direction} on a {background} background"
        (out / f"clip_{i:03d}.txt").write_text(caption + "\n", encoding="utf-8")
    return out


def make_shapes_image_dataset(
    out: str | Path, num_images: int = 16, size: tuple[int, int] = (64, 64), seed: int = 0
) -> Path:
    """Write `num_images` png stills (size = (height, width)) + captions like
    "a blue square on the left over a white background" into `out`; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    combos = list(itertools.product(SHAPES, ("left", "right")))
    rng.shuffle(combos)
    height, width = size
    radius = _radius(size)
    for i in range(num_images):
        shape, side = combos[i % len(combos)]
        colour, background = _pick_colours(rng)
        x = width / 4 if side == "left" else 3 * width / 4
        y = rng.uniform(radius + 1, height - radius - 2)
        frame = draw_shape(size, BACKGROUNDS[background], shape, SHAPE_COLOURS[colour], (x, y), radius)
        write_image(out / f"image_{i:03d}.png", frame)
        caption = f"a {colour} {shape} on the {side} over a {background} background"
        (out / f"image_{i:03d}.txt").write_text(caption + "\n", encoding="utf-8")
    return out


def make_shapes_edit_dataset(
    out: str | Path, num_pairs: int = 16, size: tuple[int, int] = (64, 64), seed: int = 0
) -> Path:
    """Write `num_pairs` edit pairs into `out`: a source png, the edited png (the same shape recoloured) and
    the instruction ("make the circle blue"), listed in `manifest.jsonl` as {"path": edited, "caption":
    instruction, "image": source} (the sample's input image); returns the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    height, width = size
    radius = _radius(size)
    lines = []
    for i in range(num_pairs):
        shape = SHAPES[i % len(SHAPES)]
        before, after = rng.sample(list(SHAPE_COLOURS), 2)
        background = BACKGROUNDS[rng.choice(list(BACKGROUNDS))]
        centre = (rng.uniform(radius + 1, width - radius - 2), rng.uniform(radius + 1, height - radius - 2))
        write_image(
            out / f"source_{i:03d}.png", draw_shape(size, background, shape, SHAPE_COLOURS[before], centre, radius)
        )
        write_image(
            out / f"edited_{i:03d}.png", draw_shape(size, background, shape, SHAPE_COLOURS[after], centre, radius)
        )
        entry = {"path": f"edited_{i:03d}.png", "caption": f"make the {shape} {after}", "image": f"source_{i:03d}.png"}
        lines.append(json.dumps(entry) + "\n")
    manifest = out / "manifest.jsonl"
    manifest.write_text("".join(lines), encoding="utf-8")
    return manifest


def write_manifest(folder: str | Path, name: str = "manifest.jsonl") -> Path:
    """Write a JSONL manifest (paths relative to `folder`) for a captioned media folder."""
    folder = Path(folder)
    manifest = folder / name
    lines = [
        json.dumps({"path": s.path.relative_to(folder).as_posix(), "caption": s.caption}) for s in scan_folder(folder)
    ]
    manifest.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return manifest


def make_text_corpus(out: str | Path, num_docs: int = 96, seed: int = 0) -> Path:
    """Write `corpus.jsonl` ({"text": ...} lines) into `out`; returns `out`.

    Short stories about the shapes in a fixed grammar ("the red circle moves left . then the red circle
    moves right .") from words the tiny tokenizer knows, so a tiny language model learns it quickly
    (its loss falls well below the uniform-guess loss) and its continuations are recognisable.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    lines = []
    for _ in range(num_docs):
        colour, background = _pick_colours(rng)
        shape = rng.choice(SHAPES)
        first, then = rng.sample(list(DIRECTIONS), 2)
        text = (
            f"the {colour} {shape} moves {first} on a {background} background . "
            f"then the {colour} {shape} moves {then} ."
        )
        lines.append(json.dumps({"text": text}))
    (out / "corpus.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return out


def make_image_conversations(
    out: str | Path,
    num_conversations: int = 8,
    size: tuple[int, int] = (56, 56),
    text_only_every: int = 0,
    seed: int = 0,
) -> Path:
    """Write `conversations.jsonl` (OpenAI/Qwen messages with an image part, images beside it) into `out`.

    Each conversation shows one shapes image and asks its colour and shape; with `text_only_every=k`
    every k-th conversation has no image (string contents). Returns the JSONL file.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = make_shapes_image_dataset(out / "images", num_images=num_conversations, size=size, seed=seed)
    lines = []
    for i in range(num_conversations):
        caption = (images / f"image_{i:03d}.txt").read_text().strip()
        messages: list[dict[str, Any]]
        if text_only_every and i % text_only_every == text_only_every - 1:
            messages = [
                {"role": "user", "content": "Which way does the shape move?"},
                {"role": "assistant", "content": "The small yellow ball bounces to the right."},
            ]
        else:
            messages = [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": f"images/image_{i:03d}.png"},
                        {"type": "text", "text": "What colour is the shape in the picture?"},
                    ],
                },
                {"role": "assistant", "content": caption[0].upper() + caption[1:] + "."},
            ]
        lines.append(json.dumps({"messages": messages}))
    path = out / "conversations.jsonl"
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
