"""Edit pairs (spindle.data.edit_pairs): the JSONL layout and the target + control folder layout give the
target as "pixels" and its sources as "images" [N, 3, H, W] (batch [B, N, 3, H, W]), decoded exactly as
the target; every bad pair is an error naming the file (and the manifest line) and the fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spindle.data.datasets import build_dataset, collate
from spindle.data.media import read_media, write_image
from spindle.data.media_check import DataCheckError
from spindle.data.synthetic import make_shapes_edit_dataset

SIZE = (32, 32)


def noise_png(path, size=(40, 56), seed=0):
    rng = np.random.default_rng(seed)
    return write_image(path, rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_manifest_sources_are_decoded_as_the_target(tmp_path):
    noise_png(tmp_path / "src.png", seed=1)
    noise_png(tmp_path / "b.png", size=(64, 48), seed=2)
    noise_png(tmp_path / "edited.png", seed=3)
    manifest = write_lines(
        tmp_path / "pairs.jsonl",
        [
            {"image": "src.png", "target": "edited.png", "caption": "make it blue"},
            {"image": ["b.png", "src.png"], "target": "edited.png", "caption": "two sources"},
        ],
    )
    dataset = build_dataset(manifest, SIZE, 1)
    one, two = dataset[0], dataset[1]
    assert one["images"].shape == (1, 3, *SIZE) and two["images"].shape == (2, 3, *SIZE)
    # resized + center-cropped like the target, same value range as "pixels"
    torch.testing.assert_close(one["pixels"][:, 0], read_media(tmp_path / "edited.png", 1, SIZE)[:, 0])
    torch.testing.assert_close(two["images"][0], read_media(tmp_path / "b.png", 1, SIZE)[:, 0])
    torch.testing.assert_close(two["images"][1], one["images"][0])
    assert "image" not in one  # the I2V conditioning key stays the I2V one
    batch = collate([dataset[0], dataset[0]])
    assert batch["images"].shape == (2, 1, 3, *SIZE) and batch["caption"] == ["make it blue"] * 2


def test_a_batch_with_different_source_counts_names_the_fix(tmp_path):
    manifest = make_shapes_edit_dataset(tmp_path / "a", num_pairs=2, size=SIZE, sources=2)
    lines = manifest.read_text().splitlines()
    first = json.loads(lines[0])
    first["image"] = first["image"][0]
    write_lines(manifest, [first, lines[1]])
    dataset = build_dataset(manifest, SIZE, 1)
    with pytest.raises(ValueError, match=r"with \[1, 2\] source images.*set train.micro_batch_size: 1"):
        collate([dataset[0], dataset[1]])


def test_control_folder_layout_follows_musubi_tuners_naming(tmp_path):
    targets, controls = tmp_path / "images", tmp_path / "control"
    (targets / "sub").mkdir(parents=True)
    (controls / "sub").mkdir(parents=True)
    for stem in ("cat", "cat_1", "sub/dog"):
        noise_png(targets / f"{stem}.png")
        (targets / f"{stem}.txt").write_text(f"edit {stem}\n")
    # several controls for "cat", numbered (ordered by the number, not the name); "cat_1.jpg" is the
    # control of the target "cat_1"; "sub/dog" has one control with another extension
    for name, seed in (
        ("cat_10.png", 10),
        ("cat_2.png", 2),
        ("cat_0000.png", 0),
        ("cat_1.jpg", 1),
        ("sub/dog.webp", 5),
    ):
        noise_png(controls / name, seed=seed)
    dataset = build_dataset(targets, SIZE, 1, control_dir=controls)
    sources = {s.path.relative_to(targets).with_suffix("").as_posix(): s.sources for s in dataset.samples}
    assert {k: [p.relative_to(controls).as_posix() for p in v] for k, v in sources.items()} == {
        "cat": ["cat_0000.png", "cat_2.png", "cat_10.png"],
        "cat_1": ["cat_1.jpg"],
        "sub/dog": ["sub/dog.webp"],
    }
    item = dataset[[s.path.stem for s in dataset.samples].index("cat")]
    assert item["images"].shape == (3, 3, *SIZE) and item["caption"] == "edit cat"
    torch.testing.assert_close(item["images"][1], read_media(controls / "cat_2.png", 1, SIZE)[:, 0])


def test_synthetic_edit_dataset_in_both_layouts_gives_the_same_pairs(tmp_path):
    manifest = make_shapes_edit_dataset(tmp_path / "m", num_pairs=3, size=SIZE, seed=4)
    targets = make_shapes_edit_dataset(tmp_path / "f", num_pairs=3, size=SIZE, seed=4, layout="folders")
    a = build_dataset(manifest, SIZE, 1)
    b = build_dataset(targets, SIZE, 1, control_dir=tmp_path / "f" / "controls")
    for i in range(3):
        x, y = a[i], b[i]
        assert x["caption"] == y["caption"]
        assert torch.equal(x["pixels"], y["pixels"]) and torch.equal(x["images"], y["images"])
        assert not torch.equal(x["pixels"][:, 0], x["images"][0])  # the edit changes the image


def test_a_target_without_control_is_named_with_where_it_was_looked_for(tmp_path):
    targets = make_shapes_edit_dataset(tmp_path, num_pairs=3, size=SIZE, layout="folders")
    (tmp_path / "controls" / "pair_001.png").unlink()
    with pytest.raises(DataCheckError, match=r"pair_001\.png: no control image in data.control_dir \(looked for "):
        build_dataset(targets, SIZE, 1, control_dir=tmp_path / "controls")
    skipped = build_dataset(targets, SIZE, 1, skip_bad_samples=True, control_dir=tmp_path / "controls")
    assert [s.path.name for s in skipped.samples] == ["pair_000.png", "pair_002.png"]
    with pytest.raises(FileNotFoundError, match=r"data.control_dir=.*nowhere is not a folder"):
        build_dataset(targets, SIZE, 1, control_dir=tmp_path / "nowhere")


def test_missing_or_undecodable_sources_are_named_with_their_manifest_line(tmp_path):
    manifest = make_shapes_edit_dataset(tmp_path, num_pairs=3, size=SIZE)
    (tmp_path / "pair_001_source0.png").unlink()
    (tmp_path / "pair_002_source0.png").write_bytes(b"not a png")
    with pytest.raises(DataCheckError) as err:
        build_dataset(manifest, SIZE, 1)
    message = str(err.value)
    assert "2 of 3 sample(s) cannot be used" in message
    assert f"pair_001.png: source image {tmp_path / 'pair_001_source0.png'} ({manifest}:2): file does not exist" in (
        message
    )
    assert f"source image {tmp_path / 'pair_002_source0.png'} ({manifest}:3): " in message


@pytest.mark.parametrize(
    "line,match",
    [
        ({"image": "a.png", "caption": "x"}, r"line 1: missing key 'target' \(an edit pair needs"),
        ({"image": "a.png", "target": "b.png"}, r"line 1: missing key 'caption'"),
        ({"target": "b.png", "caption": "x"}, r"line 1: missing key 'image'"),
        (
            {"image": [], "target": "b.png", "caption": "x"},
            r"line 1: 'image' must be a source image path or a non-empty",
        ),
        ({"image": [3], "target": "b.png", "caption": "x"}, r"line 1: 'image' must be a source image path"),
        (
            {"image": "a.mp4", "target": "b.png", "caption": "x"},
            r"'image' must be an image file; unsupported extension",
        ),
        ({"image": "a.png", "target": "b.txt", "caption": "x"}, r"'target' must be an image file"),
        ({"image": "a.png", "target": "b.png", "path": "b.png", "caption": "x"}, r'line 1: give "target" .* not both'),
    ],
)
def test_bad_manifest_lines_name_the_line_and_the_key(tmp_path, line, match):
    manifest = write_lines(tmp_path / "pairs.jsonl", [line])
    with pytest.raises(ValueError, match=match):
        build_dataset(manifest, SIZE, 1)


def test_control_dir_with_a_manifest_is_refused(tmp_path):
    manifest = make_shapes_edit_dataset(tmp_path, num_pairs=1, size=SIZE)
    with pytest.raises(ValueError, match=r"data.control_dir is for a folder data.path; .* is a manifest"):
        build_dataset(manifest, SIZE, 1, control_dir=tmp_path)
