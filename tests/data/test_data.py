"""Data layer: real media written to disk and read back; datasets; deterministic resumable loader."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from spindle.data.datasets import MediaDataset, Sample, build_dataset, collate
from spindle.data.loader import ResumableLoader
from spindle.data.media import (
    MediaError,
    probe_video,
    read_image,
    read_media,
    read_video,
    resize_center_crop,
    sample_frame_indices,
    write_image,
    write_video,
)
from spindle.data.media_check import DataCheckError
from spindle.data.synthetic import (
    BACKGROUNDS,
    make_shapes_image_dataset,
    make_shapes_video_dataset,
    write_manifest,
)

# Levels in [-1, 1] units: H.264 at crf 18 on flat colours is within a few 8-bit levels.
TOL = 6 / 127.5

TOKENIZER_WORDS = set(
    "red green blue yellow orange purple pink white black gray cyan magenta brown circle square "
    "triangle box ball moves moving left right up down across toward the a on over background".split()
)


def to_levels(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels + 1) * 127.5


@pytest.fixture(scope="module")
def video_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shapes_video_dataset(tmp_path_factory.mktemp("shapes"), num_videos=4, num_frames=9, size=(32, 48))


def gray_ramp_video(path: Path, num_frames: int = 10, step: int = 25, size: tuple[int, int] = (16, 24)) -> Path:
    """Frame k is flat gray at level k * step: the decoded level identifies the frame."""
    frames = np.stack([np.full((*size, 3), k * step, np.uint8) for k in range(num_frames)])
    return write_video(path, frames, fps=8)


def corrupt_file(path: Path, seed: int = 0) -> Path:
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return path


# ----------------------------------------------------------------------------- media


def test_read_video_shape_range_and_even_frame_sampling(tmp_path: Path) -> None:
    video = gray_ramp_video(tmp_path / "ramp.mp4")
    assert probe_video(video) == (10, 8.0, 24, 16)

    pixels = read_video(video, num_frames=4, resolution=(8, 8))
    assert pixels.shape == (3, 4, 8, 8) and pixels.dtype == torch.float32
    assert pixels.min() >= -1 and pixels.max() <= 1
    # round(linspace(0, 9, 4)) = [0, 3, 6, 9]
    levels = to_levels(pixels).mean(dim=(0, 2, 3))
    torch.testing.assert_close(levels, torch.tensor([0.0, 75.0, 150.0, 225.0]), atol=6, rtol=0)


def test_short_clip_repeats_frames_evenly(tmp_path: Path) -> None:
    video = gray_ramp_video(tmp_path / "short.mp4", num_frames=3, step=100)
    assert sample_frame_indices(3, 7) == [0, 0, 1, 1, 1, 2, 2]
    levels = to_levels(read_video(video, num_frames=7, resolution=(8, 8))).mean(dim=(0, 2, 3))
    torch.testing.assert_close(levels, torch.tensor([0.0, 0, 100, 100, 100, 200, 200]), atol=6, rtol=0)


def test_write_video_odd_size_float_input_and_torch(tmp_path: Path) -> None:
    frames = torch.full((5, 15, 21, 3), 0.5)  # float in [0, 1], odd H and W
    out = write_video(tmp_path / "sub" / "odd.mp4", frames, fps=12)
    num, fps, width, height = probe_video(out)
    assert (num, fps, width, height) == (5, 12.0, 22, 16)  # padded to even by one replicated pixel
    assert not list(out.parent.glob(".*tmp"))  # temp file renamed away
    pixels = read_video(out, 5, (16, 22))
    assert abs(to_levels(pixels).mean().item() - 127.5) < 3


def test_write_video_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[F>0, H, W, 3\]"):
        write_video(tmp_path / "bad.mp4", np.zeros((4, 8, 8), np.uint8))
    with pytest.raises(ValueError, match="writes"):
        write_video(tmp_path / "bad.webm", np.zeros((1, 8, 8, 3), np.uint8))


def test_resize_center_crop_wide_image_keeps_center(tmp_path: Path) -> None:
    # 120x60 image: red | green | blue thirds. Covering 32x32 scales to 64x32 and keeps x in
    # [30, 90) of the source: a red sliver, all the green, a blue sliver.
    array = np.zeros((60, 120, 3), np.uint8)
    array[:, :40] = (255, 0, 0)
    array[:, 40:80] = (0, 255, 0)
    array[:, 80:] = (0, 0, 255)
    img = Image.fromarray(array)
    cropped = resize_center_crop(img, (32, 32))
    assert cropped.size == (32, 32)
    out = np.asarray(cropped).astype(int)
    assert np.abs(out[16, 16] - (0, 255, 0)).max() < 10
    assert out[16, 0, 0] > 200 and out[16, 0, 1] < 60  # left edge: red
    assert out[16, 31, 2] > 200 and out[16, 31, 1] < 60  # right edge: blue

    write_image(tmp_path / "wide.png", array)
    pixels = read_image(tmp_path / "wide.png", (32, 32))
    assert pixels.shape == (3, 1, 32, 32)
    torch.testing.assert_close(pixels[:, 0, 16, 16], torch.tensor([-1.0, 1.0, -1.0]), atol=TOL, rtol=0)


def test_resize_center_crop_tall_image_to_non_square() -> None:
    # 40x100 (W x H) with top/middle/bottom bands; target H=16, W=32 -> 32x80, rows [32, 48).
    array = np.zeros((100, 40, 3), np.uint8)
    array[:40] = (255, 0, 0)
    array[40:60] = (0, 255, 0)
    array[60:] = (0, 0, 255)
    cropped = resize_center_crop(Image.fromarray(array), (16, 32))
    assert cropped.size == (32, 16)
    out = np.asarray(cropped).astype(int)
    assert np.abs(out[8, 16] - (0, 255, 0)).max() < 10


def test_read_image_converts_modes(tmp_path: Path) -> None:
    Image.new("L", (10, 10), 200).save(tmp_path / "gray.png")
    rgba = Image.new("RGBA", (10, 10), (255, 0, 0, 0))  # fully transparent red -> white
    rgba.save(tmp_path / "alpha.png")
    gray = read_image(tmp_path / "gray.png", (4, 4))
    assert gray.shape == (3, 1, 4, 4)
    torch.testing.assert_close(to_levels(gray), torch.full_like(gray, 200.0), atol=1, rtol=0)
    torch.testing.assert_close(read_image(tmp_path / "alpha.png", (4, 4)), torch.ones(3, 1, 4, 4))


def test_read_media_dispatch_and_errors(tmp_path: Path) -> None:
    video = gray_ramp_video(tmp_path / "v.mp4")
    Image.new("RGB", (8, 8)).save(tmp_path / "i.jpg")
    assert read_media(video, 5, (8, 8)).shape == (3, 5, 8, 8)
    assert read_media(tmp_path / "i.jpg", 5, (8, 8)).shape == (3, 1, 8, 8)  # images stay 1 frame

    (tmp_path / "notes.doc").write_text("x")
    with pytest.raises(MediaError, match=r"notes\.doc.*unsupported extension"):
        read_media(tmp_path / "notes.doc", 5, (8, 8))
    with pytest.raises(MediaError, match=r"missing\.mp4.*does not exist"):
        read_media(tmp_path / "missing.mp4", 5, (8, 8))


def test_corrupt_files_raise_media_error_naming_file(tmp_path: Path) -> None:
    for name in ("broken.mp4", "broken.png"):
        bad = corrupt_file(tmp_path / name)
        with pytest.raises(MediaError) as info:
            read_media(bad, 5, (8, 8))
        assert str(bad) in str(info.value)
        assert "data.skip_bad_samples=true" in str(info.value)
        assert info.value.path == bad


def test_audio_only_file_has_no_video_stream(tmp_path: Path) -> None:
    import av

    path = tmp_path / "audio.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(MediaError, match="no video stream"):
        read_video(path, 5, (8, 8))


# ----------------------------------------------------------------------------- datasets


def test_folder_dataset_recursive_with_captions(tmp_path: Path, video_folder: Path) -> None:
    root = tmp_path / "data"
    (root / "nested").mkdir(parents=True)
    for name in ("clip_000", "clip_001"):
        for ext in (".mp4", ".txt"):
            shutil.copy(video_folder / f"{name}{ext}", root / ("nested" if name == "clip_001" else "") / f"{name}{ext}")
    (root / "clip_000.txt").write_text("  a red ball moves up \n")  # stripped
    dataset = build_dataset(root, resolution=(16, 16), num_frames=5)
    assert len(dataset) == 2
    assert [s.path for s in dataset.samples] == [root / "clip_000.mp4", root / "nested" / "clip_001.mp4"]
    item = dataset[0]
    assert item["caption"] == "a red ball moves up"
    assert item["index"] == 0
    assert item["pixels"].shape == (3, 5, 16, 16)
    assert -1 <= item["pixels"].min() and item["pixels"].max() <= 1
    assert dataset[1]["caption"] == (video_folder / "clip_001.txt").read_text().strip()


def test_missing_caption_names_txt(tmp_path: Path) -> None:
    gray_ramp_video(tmp_path / "lonely.mp4")
    with pytest.raises(DataCheckError, match=r"lonely\.txt: caption file missing for lonely\.mp4"):
        build_dataset(tmp_path, (8, 8), 5)


def test_missing_and_empty_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_dataset(tmp_path / "nowhere", (8, 8), 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no samples"):
        build_dataset(tmp_path / "empty", (8, 8), 5)


def test_jsonl_manifest_relative_paths(tmp_path: Path, video_folder: Path) -> None:
    manifest_dir = tmp_path / "meta"
    (manifest_dir / "clips").mkdir(parents=True)
    shutil.copy(video_folder / "clip_002.mp4", manifest_dir / "clips" / "x.mp4")
    Image.new("RGB", (20, 10), (0, 0, 255)).save(manifest_dir / "still.png")
    lines = [
        json.dumps({"path": "clips/x.mp4", "caption": "a cyan box"}),
        "",
        json.dumps({"path": "still.png", "caption": "a blue background "}),
    ]
    manifest = manifest_dir / "train.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    dataset = build_dataset(manifest, (8, 8), 5)
    assert [s.path for s in dataset.samples] == [manifest_dir / "clips" / "x.mp4", manifest_dir / "still.png"]
    assert [dataset[i]["caption"] for i in range(2)] == ["a cyan box", "a blue background"]
    assert dataset[0]["pixels"].shape == (3, 5, 8, 8)
    assert dataset[1]["pixels"].shape == (3, 1, 8, 8)
    torch.testing.assert_close(dataset[1]["pixels"][:, 0, 4, 4], torch.tensor([-1.0, -1.0, 1.0]))


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", r"bad\.jsonl, line 2: invalid JSON"),
        ('{"path": "a.mp4"}', r"bad\.jsonl, line 2: missing key 'caption'"),
        ('{"caption": "a"}', r"bad\.jsonl, line 2: missing key 'path'"),
        ('["a.mp4", "a"]', r"bad\.jsonl, line 2: expected an object"),
    ],
)
def test_manifest_bad_line_names_line(tmp_path: Path, bad_line: str, message: str) -> None:
    gray_ramp_video(tmp_path / "a.mp4")
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text(json.dumps({"path": "a.mp4", "caption": "a"}) + "\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=message):
        build_dataset(manifest, (8, 8), 5)


def test_manifest_missing_file_is_reported(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"path": "gone.mp4", "caption": "a"}) + "\n")
    with pytest.raises(DataCheckError, match=r"gone\.mp4: file does not exist"):
        build_dataset(manifest, (8, 8), 5)


def test_skip_bad_samples(tmp_path: Path, video_folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("clip_000", "clip_002"):
        for ext in (".mp4", ".txt"):
            shutil.copy(video_folder / f"{name}{ext}", tmp_path / f"{name}{ext}")
    bad = corrupt_file(tmp_path / "clip_001.mp4")
    (tmp_path / "clip_001.txt").write_text("a black box")

    with pytest.raises(DataCheckError, match=r"clip_001\.mp4"):  # found when the dataset is built
        build_dataset(tmp_path, (8, 8), 5)

    with caplog.at_level(logging.WARNING, logger="spindle.data.datasets"):
        lenient = build_dataset(tmp_path, (8, 8), 5, skip_bad_samples=True)
    assert "skipping 1 of 3 samples (clip_001.mp4)" in caplog.text
    assert lenient.skipped_files == [bad]
    assert [s.path.name for s in lenient.samples] == ["clip_000.mp4", "clip_002.mp4"]


def test_a_sample_that_goes_bad_while_training_is_skipped(tmp_path: Path, video_folder: Path, caplog) -> None:
    """The up-front check passed, then a file changed: MediaDataset skips it at load time too."""
    samples = [Sample(shutil.copy(video_folder / f"clip_00{i}.mp4", tmp_path / f"c{i}.mp4"), f"c{i}") for i in range(3)]
    lenient = MediaDataset(samples, (8, 8), 5, skip_bad_samples=True)
    bad = corrupt_file(samples[1].path)
    with caplog.at_level(logging.WARNING, logger="spindle.data.datasets"):
        item = lenient[1]
    assert item["index"] == 2  # the next good sample, deterministically
    assert lenient.num_skipped == 1
    assert str(bad) in caplog.text
    lenient[1]  # known bad: not decoded again, not counted twice
    assert lenient.num_skipped == 1
    assert lenient[0]["index"] == 0


def test_all_bad_samples_raise(tmp_path: Path) -> None:
    samples = [Sample(corrupt_file(tmp_path / f"b{i}.mp4", seed=i), "a") for i in range(2)]
    dataset = MediaDataset(samples, (8, 8), 5, skip_bad_samples=True)
    with pytest.raises(MediaError, match="every one of the 2 samples"):
        dataset[0]
    assert dataset.num_skipped == 2


def test_collate_stacks_and_refuses_mixed_frame_counts() -> None:
    video = {"pixels": torch.zeros(3, 5, 8, 8), "caption": "a", "index": 3}
    image = {"pixels": torch.zeros(3, 1, 8, 8), "caption": "b", "index": 4}
    batch = collate([video, dict(video, index=7, caption="c")])
    assert batch["pixels"].shape == (2, 3, 5, 8, 8)
    assert batch["caption"] == ["a", "c"]
    assert batch["index"].tolist() == [3, 7]
    with pytest.raises(ValueError, match=r"frame counts \[1, 5\]"):
        collate([video, image])


# ----------------------------------------------------------------------------- loader


class IndexDataset(torch.utils.data.Dataset):
    """Decode-free stand-in: the loader's logic does not depend on what the samples hold."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"pixels": torch.full((3, 1, 2, 2), float(i)), "caption": f"c{i}", "index": i}


def batch_indices(loader: ResumableLoader, steps: int) -> list[list[int]]:
    return [next(loader)["index"].tolist() for _ in range(steps)]


def test_loader_ranks_split_the_same_permutation() -> None:
    n, mbs, dp, seed = 11, 2, 2, 5
    loaders = [ResumableLoader(IndexDataset(n), mbs, rank, dp, seed) for rank in range(dp)]
    assert loaders[0].steps_per_epoch == 2  # 11 // 4: the 3-sample tail is dropped
    per_rank = [batch_indices(loader, 4) for loader in loaders]  # two epochs
    for epoch in range(2):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for step in range(2):
            a, b = per_rank[0][epoch * 2 + step], per_rank[1][epoch * 2 + step]
            assert len(a) == len(b) == mbs
            assert not set(a) & set(b)
            assert a + b == perm[step * 4 : step * 4 + 4]
    epoch0 = per_rank[0][0] + per_rank[1][0] + per_rank[0][1] + per_rank[1][1]
    epoch1 = per_rank[0][2] + per_rank[1][2] + per_rank[0][3] + per_rank[1][3]
    assert epoch0 != epoch1  # each epoch reshuffles
    assert len(set(epoch0)) == 8


def test_loader_without_shuffle_and_tiny_dataset() -> None:
    ordered = ResumableLoader(IndexDataset(6), 3, 1, 2, seed=0, shuffle=False)
    assert batch_indices(ordered, 2) == [[3, 4, 5], [3, 4, 5]]
    # 3 samples < global batch of 4: indices cycle so every rank still gets a full micro-batch.
    tiny = [ResumableLoader(IndexDataset(3), 2, r, 2, seed=1) for r in range(2)]
    assert tiny[0].steps_per_epoch == 1
    got = batch_indices(tiny[0], 1)[0] + batch_indices(tiny[1], 1)[0]
    perm = torch.randperm(3, generator=torch.Generator().manual_seed(1)).tolist()
    assert got == perm + perm[:1]


def test_loader_resume_reproduces_uninterrupted_run() -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(13), 2, 1, 2, seed=3)

    reference = make()
    assert reference.steps_per_epoch == 3
    first = batch_indices(reference, 4)  # crosses into epoch 1
    state = reference.state_dict()
    assert state == {"epoch": 1, "position": 1}
    expected = batch_indices(reference, 5)

    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert batch_indices(resumed, 5) == expected
    assert resumed.state_dict() == reference.state_dict()
    assert first[:3] != expected[2:5]  # epochs differ, so the comparison is not vacuous

    # Resuming exactly at an epoch boundary rolls over to the next epoch.
    at_end = make()
    at_end.load_state_dict({"epoch": 0, "position": 3})
    assert batch_indices(at_end, 1) == [first[3]]


def test_loader_state_validation() -> None:
    loader = ResumableLoader(IndexDataset(8), 2, 0, 1, seed=0)
    with pytest.raises(ValueError, match="steps per epoch"):
        loader.load_state_dict({"epoch": 0, "position": 99})
    with pytest.raises(KeyError, match="position"):
        loader.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="dp_rank"):
        ResumableLoader(IndexDataset(8), 2, 2, 2, seed=0)


def step_samples(loaders: list[ResumableLoader], steps: int) -> list[list[int]]:
    """The samples of each optimizer step, in (micro-step, rank) order, whatever the split."""
    out = []
    for _ in range(steps):
        micro = [[next(loader)["index"].tolist() for loader in loaders] for _ in range(loaders[0].accum)]
        out.append([i for ranks in micro for batch in ranks for i in batch])
    return out


# (micro_batch_size, dp_size) splits of one global batch of 4
SPLITS = [(2, 2), (4, 1), (1, 1), (1, 4)]


def test_loader_order_depends_only_on_the_global_batch() -> None:
    """10 samples, global batch 4 (divides no split's tail): every split of the global batch over
    micro-batches, accumulation and ranks sees the same samples in the same steps for 3 epochs."""
    n, gbs, seed = 10, 4, 11
    sequences = {}
    for mbs, dp in SPLITS:
        loaders = [ResumableLoader(IndexDataset(n), mbs, r, dp, seed, global_batch_size=gbs) for r in range(dp)]
        assert loaders[0].global_steps_per_epoch == 2
        sequences[(mbs, dp)] = step_samples(loaders, 6)  # 3 epochs
    reference = sequences[SPLITS[0]]
    for split, seq in sequences.items():
        assert seq == reference, split
    for epoch in range(3):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        assert reference[2 * epoch] + reference[2 * epoch + 1] == perm[:8]


def test_loader_resume_at_another_world_size_keeps_the_trajectory() -> None:
    """2 ranks x 2 samples stop mid-epoch 2; 1 rank (4 x 1 accumulation) resumes from the saved
    sample count (what the trainer stores) and sees what the 2-rank run would have seen."""
    n, gbs, seed = 10, 4, 2
    two = [ResumableLoader(IndexDataset(n), 2, r, 2, seed, global_batch_size=gbs) for r in range(2)]
    uninterrupted = step_samples(two, 5)
    first = [ResumableLoader(IndexDataset(n), 2, r, 2, seed, global_batch_size=gbs) for r in range(2)]
    step_samples(first, 3)  # epoch 0 (2 steps) + 1 step of epoch 1
    state = first[0].state_dict()
    samples_in_epoch = state["position"] * 2 * 2
    one = ResumableLoader(IndexDataset(n), 1, 0, 1, seed, global_batch_size=gbs)
    one.load_state_dict({"epoch": state["epoch"], "position": samples_in_epoch // 1})
    assert step_samples([one], 2) == uninterrupted[3:5]


def test_loader_rejects_a_global_batch_the_split_does_not_divide() -> None:
    with pytest.raises(ValueError, match="global_batch_size"):
        ResumableLoader(IndexDataset(8), 2, 0, 2, seed=0, global_batch_size=6)


def test_loader_workers_match_in_process_loading(video_folder: Path) -> None:
    dataset = build_dataset(video_folder, (8, 8), 3)
    in_process = ResumableLoader(dataset, 1, 0, 1, seed=7)
    with_workers = ResumableLoader(dataset, 1, 0, 1, seed=7, num_workers=1)
    for _ in range(5):  # crosses an epoch boundary (4 samples)
        a, b = next(in_process), next(with_workers)
        assert a["index"].tolist() == b["index"].tolist()
        assert a["caption"] == b["caption"]
        torch.testing.assert_close(a["pixels"], b["pixels"])
    assert with_workers.state_dict() == {"epoch": 1, "position": 1}


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_video_dataset(tmp_path: Path, video_folder: Path) -> None:
    assert sorted(p.name for p in video_folder.glob("*.mp4")) == [f"clip_{i:03d}.mp4" for i in range(4)]
    assert len(list(video_folder.glob("*.txt"))) == 4
    for txt in video_folder.glob("*.txt"):
        assert set(txt.read_text().split()) <= TOKENIZER_WORDS
    for mp4 in video_folder.glob("*.mp4"):
        assert probe_video(mp4) == (9, 8.0, 48, 32)

    # The clip shows what its caption says: the shape's centroid moves in the named direction
    # and the first pixel is the named background.
    caption = (video_folder / "clip_000.txt").read_text().split()
    direction, background = caption[caption.index("moves") + 1], caption[-2]
    frames = to_levels(read_video(video_folder / "clip_000.mp4", 9, (32, 48)))  # [3, F, H, W]
    bg = torch.tensor(BACKGROUNDS[background], dtype=torch.float32).view(3, 1, 1)
    torch.testing.assert_close(frames[:, 0, 0, 0], bg.flatten(), atol=6, rtol=0)

    def centroid(frame: torch.Tensor) -> torch.Tensor:
        mask = (frame - bg).abs().amax(0) > 40
        ys, xs = torch.nonzero(mask, as_tuple=True)
        return torch.stack([xs.float().mean(), ys.float().mean()])

    dx, dy = (centroid(frames[:, -1]) - centroid(frames[:, 0])).tolist()
    expected = {"left": dx < -10, "right": dx > 10, "up": dy < -10, "down": dy > 10}
    assert expected[direction], (direction, dx, dy)

    # Deterministic given the seed: same caption and same clip. H.264 encodes of identical frames
    # are not always byte-identical (see write_video), so compare decoded pixels on average.
    again = make_shapes_video_dataset(tmp_path / "again", num_videos=1, num_frames=9, size=(32, 48))
    assert (again / "clip_000.txt").read_text() == (video_folder / "clip_000.txt").read_text()
    assert (to_levels(read_video(again / "clip_000.mp4", 9, (32, 48))) - frames).abs().mean() < 2
    other = make_shapes_video_dataset(tmp_path / "other", num_videos=4, num_frames=9, size=(32, 48), seed=1)
    assert [(other / f"clip_{i:03d}.txt").read_text() for i in range(4)] != [
        (video_folder / f"clip_{i:03d}.txt").read_text() for i in range(4)
    ]


def test_synthetic_images_and_manifest(tmp_path: Path) -> None:
    folder = make_shapes_image_dataset(tmp_path / "imgs", num_images=3, size=(24, 32))
    captions = [(folder / f"image_{i:03d}.txt").read_text().strip() for i in range(3)]
    assert all(set(c.split()) <= TOKENIZER_WORDS for c in captions)
    assert Image.open(folder / "image_000.png").size == (32, 24)

    manifest = write_manifest(folder)
    entries = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert [e["path"] for e in entries] == [f"image_{i:03d}.png" for i in range(3)]
    dataset = build_dataset(manifest, (24, 32), 9)
    assert [dataset[i]["caption"] for i in range(3)] == captions
    assert dataset[0]["pixels"].shape == (3, 1, 24, 32)
