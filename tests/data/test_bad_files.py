"""Every bad input file is named and, with `data.skip_bad_samples`, skipped and counted: images over
Pillow's decompression-bomb limit or, with `data.max_pixels`, too big to decode in bounded memory
(`spindle.data.media.load_image`), caption files and JSONL lines that are not UTF-8. As an operator meets
them: real files, `spindle train` in a subprocess for the run that must succeed."""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from spindle.data.datasets import build_dataset
from spindle.data.media import DECODE_FACTOR, MediaError, load_image
from spindle.data.media_check import DataCheckError
from spindle.data.multimodal import VisionOptions, VisionProcessor, build_conversation_dataset
from spindle.data.text import TextDataError
from spindle.testing.multiprocess import run_spindle
from tests.conftest import vlm_overrides


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def write_png(path: Path, width: int, height: int, cut: bool = False) -> Path:
    """A real 1-bit greyscale PNG of `width` x `height` (all black, so it compresses to kilobytes) written
    without ever holding its pixels; `cut`: the file ends within its pixel data (a truncated download)."""
    row = b"\x00" + bytes((width + 7) // 8)
    z = zlib.compressobj(9)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    path.write_bytes(data[: 33 + 8 + len(idat) // 2] if cut else data)
    return path


@pytest.fixture(scope="module")
def bomb_conversations(vlm_conversations, tmp_path_factory) -> Path:
    """The 8 shapes conversations plus, as line 9, one showing a 20000 x 20000 PNG."""
    folder = tmp_path_factory.mktemp("bomb") / "data"
    shutil.copytree(vlm_conversations.parent, folder)
    write_png(folder / "huge.png", 20000, 20000)
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "huge.png"}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "A black square."},
        ]
    }
    with (folder / vlm_conversations.name).open("a") as f:
        f.write(json.dumps(line) + "\n")
    return folder / vlm_conversations.name


def processor(model: Path, **options) -> VisionProcessor:
    from transformers import AutoConfig, AutoTokenizer

    from spindle.registry import get_family

    tok, config = AutoTokenizer.from_pretrained(model), AutoConfig.from_pretrained(model)
    return VisionProcessor(model, tok, config, get_family("qwen2_5_vl").rope_index_fn(), VisionOptions(**options))


def test_a_decompression_bomb_in_a_conversation_is_a_named_line_or_a_counted_skip(tiny_qwen2_5_vl, bomb_conversations):
    p = processor(tiny_qwen2_5_vl)
    with pytest.raises(TextDataError) as e:
        build_conversation_dataset(bomb_conversations, p, 256)
    message = str(e.value)
    assert f"{bomb_conversations}:9: image {bomb_conversations.parent / 'huge.png'}" in message, message
    assert "decompression-bomb limit" in message and "skip_bad_samples" in message, message
    data = build_conversation_dataset(bomb_conversations, p, 256, skip_bad_samples=True)
    assert data.stats.skipped == 1 and data.stats.documents == 8


def test_a_vlm_run_with_skip_bad_samples_skips_the_bomb_and_succeeds(tiny_qwen2_5_vl, bomb_conversations, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text("{}\n")
    out = tmp_path / "run"
    overrides = vlm_overrides(tiny_qwen2_5_vl, bomb_conversations, out, train__max_steps=2, data__skip_bad_samples=True)
    proc = run_spindle("train", config, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["start"]["data"]["skipped"] == 1 and summary["end"]["last_step"] == 2, summary
    assert "huge.png" in proc.stderr  # the skip is logged with the file


def test_without_skip_the_run_stops_with_one_line_naming_the_file(tiny_qwen2_5_vl, bomb_conversations, spindle_cli):
    config = bomb_conversations.parent / "job.yaml"
    config.write_text("{}\n")
    r = spindle_cli("train", config, *vlm_overrides(tiny_qwen2_5_vl, bomb_conversations, config.parent / "run"))
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "huge.png" in errors[0] and ":9:" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_max_pixels_bounds_what_is_decoded(tmp_path):
    max_pixels = 28 * 28
    side = 240  # 57600 pixels > 64 x 784: too big to decode in full for this max_pixels
    assert side * side > DECODE_FACTOR * max_pixels
    # a PNG has no reduced decode: refused from its header (the pixel data is cut short: were it decoded,
    # the error would be Pillow's "truncated" instead of the bound)
    png = write_png(tmp_path / "big.png", side, side, cut=True)
    with pytest.raises(MediaError, match=rf"big.png: {side}x{side} = {side * side} pixels is more than 64 x"):
        load_image(png, max_pixels)
    with pytest.raises(MediaError, match="truncated"):
        load_image(png)  # unbounded it is decoded, and its damage found
    # a JPEG decodes reduced (draft mode), to no less than 4 x max_pixels, within the bound
    rng = np.random.default_rng(0)
    jpeg = tmp_path / "big.jpg"
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(jpeg, quality=90)
    img = load_image(jpeg, max_pixels)
    w, h = img.size
    assert 4 * max_pixels <= w * h <= DECODE_FACTOR * max_pixels and (w, h) != (side, side)
    # an image within the bound decodes in full, exactly as Pillow alone decodes it
    small = tmp_path / "small.jpg"
    Image.fromarray(rng.integers(0, 255, (100, 100, 3), dtype=np.uint8)).save(small)
    assert np.array_equal(np.asarray(load_image(small, max_pixels)), np.asarray(Image.open(small).convert("RGB")))


def test_max_pixels_refusal_is_a_skippable_vlm_sample(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(vlm_conversations.parent, folder)
    data = folder / vlm_conversations.name
    write_png(folder / "wide.png", 2000, 200)
    line = {
        "images": ["wide.png"],
        "conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "Black."}],
    }
    with data.open("a") as f:
        f.write(json.dumps(line) + "\n")
    p = processor(tiny_qwen2_5_vl, max_pixels=56 * 56)
    with pytest.raises(TextDataError, match=r":9: image .*wide.png cannot be decoded \(2000x200 = 400000 pixels"):
        build_conversation_dataset(data, p, 256)
    assert build_conversation_dataset(data, p, 256, skip_bad_samples=True).stats.skipped == 1


def test_a_non_utf8_jsonl_line_in_conversations_is_named_and_skippable(tiny_qwen2_5_vl, vlm_conversations, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(vlm_conversations.parent, folder)
    data = folder / vlm_conversations.name
    lines = data.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"What colour", b"What \xff colour")
    data.write_bytes(b"".join(lines))
    p = processor(tiny_qwen2_5_vl)
    with pytest.raises(TextDataError, match=rf"{data}:3: not UTF-8 \(byte 0xff"):
        build_conversation_dataset(data, p, 256)
    assert build_conversation_dataset(data, p, 256, skip_bad_samples=True).stats.skipped == 1


def test_a_non_utf8_caption_file_is_named_and_skippable(shapes_images, tmp_path):
    data = tmp_path / "images"
    shutil.copytree(shapes_images, data)
    caption = sorted(data.glob("*.txt"))[2]
    caption.write_bytes(b"a red \xe9 circle")  # Latin-1
    with pytest.raises(DataCheckError, match=rf"{caption}: caption of .* not UTF-8 \(byte 0xe9 at byte 7\)"):
        build_dataset(data, (32, 32), 1)
    dataset = build_dataset(data, (32, 32), 1, skip_bad_samples=True)
    assert dataset.skipped_files == [caption] and len(dataset) == 7


def test_a_non_utf8_manifest_line_is_named_and_skippable(shapes_images, tmp_path):
    data = tmp_path / "images"
    shutil.copytree(shapes_images, data)
    entries = [{"path": p.name, "caption": p.with_suffix(".txt").read_text()} for p in sorted(data.glob("*.png"))]
    lines = [json.dumps(e).encode() for e in entries]
    lines[4] = lines[4].replace(b'"caption": "', b'"caption": "\xff')
    manifest = data / "train.jsonl"
    manifest.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataCheckError, match=rf"{manifest}: line 5: not UTF-8 \(byte 0xff"):
        build_dataset(manifest, (32, 32), 1)
    dataset = build_dataset(manifest, (32, 32), 1, skip_bad_samples=True)
    assert dataset.skipped_files == [manifest] and len(dataset) == 7


def test_a_decompression_bomb_in_a_dit_dataset_is_named_and_skippable(shapes_images, tmp_path):
    data = tmp_path / "images"
    shutil.copytree(shapes_images, data)
    write_png(data / "huge.png", 20000, 20000)
    (data / "huge.txt").write_text("a black square")
    with pytest.raises(
        DataCheckError, match=r"huge.png: Image size \(400000000 pixels\) exceeds limit .*decompression-bomb limit"
    ):
        build_dataset(data, (32, 32), 1)
    dataset = build_dataset(data, (32, 32), 1, skip_bad_samples=True)
    assert dataset.skipped_files == [data / "huge.png"] and len(dataset) == 8
