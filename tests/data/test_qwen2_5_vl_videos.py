"""Qwen2.5-VL video conversations (spindle.data.stock_video `Qwen2VLVideos`): the tokens, pixels, grids,
seconds per grid and 3-D positions of stock transformers' Qwen2_5_VLProcessor with its Qwen2VLVideoProcessor
and of the stock model's get_rope_index; the frames stock samples and the size stock resizes them to, from the
checkpoint's video config (else its preprocessor_config.json, as stock falls back)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from spindle.data.multimodal import build_conversation_dataset, collate_vision, conversation_document
from spindle.testing.vlm_conformance import stock_video_inputs, stock_video_processor
from tests.data.test_qwen3_vl_videos import noise_video, processor_of


def stock_resize(video_processor, frames: int, height: int, width: int) -> list[int]:
    """The [height, width] stock `Qwen2VLVideoProcessor.resize` picks for `frames` frames of height x width (the
    processor's whole rule, its per-frame cap included; only torchvision's resampling after it is left out)."""
    from transformers.image_processing_backends import TorchvisionBackend

    picked = []

    def record(self, image, size, **kwargs):  # what stock's resize hands torchvision
        picked.append([size.height, size.width])
        return image

    vp = video_processor
    original = TorchvisionBackend.resize
    TorchvisionBackend.resize = record
    try:
        vp.resize(
            torch.zeros(1, frames, 3, height, width),
            size=vp.size,
            resample=vp.resample,
            factor=vp.patch_size * vp.merge_size,
            temporal_factor=vp.temporal_patch_size,
            cap_pixels_per_frame=vp.cap_pixels_per_frame,
        )
    finally:
        TorchvisionBackend.resize = original
    return picked[0]


def test_video_tokens_pixels_seconds_and_positions_equal_stock(tiny_qwen2_5_vl, tmp_path):
    """A 3 s clip (12 frames at 4 fps: 6 sampled at 2 fps, 3 temporal patches, 1 s a patch) and a 7-frame 8 fps
    one (raised to min_frames=4 of 7: sampled at 4/7 x 8 fps, 0.4375 s a patch), both at stock's size."""
    from transformers import AutoModelForImageTextToText

    noise_video(tmp_path / "a.mp4", 12, 56, 56, fps=4, seed=1)
    noise_video(tmp_path / "b.mp4", 7, 28, 56, fps=8, seed=2)
    user = [
        {"type": "video", "video": "a.mp4"},
        {"type": "text", "text": "and"},
        {"type": "video", "video": "b.mp4"},
        {"type": "text", "text": "What moves?"},
    ]
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "Nothing."}]
    processor = processor_of(tiny_qwen2_5_vl)
    doc, cut = conversation_document({"messages": messages}, tmp_path, processor, 4096, "x:1")
    stock = stock_video_inputs(tiny_qwen2_5_vl, messages, tmp_path, max_frames=16, fps=2.0)

    assert not cut and stock["input_ids"][0].tolist() == doc.tokens
    ours = collate_vision(doc.vision)
    assert ours["video_grid_thw"].tolist() == stock["video_grid_thw"].tolist() == [[3, 4, 4], [2, 2, 4]]
    assert ours["second_per_grid_ts"].tolist() == pytest.approx(stock["second_per_grid_ts"].tolist()) == [1.0, 0.4375]
    torch.testing.assert_close(ours["pixel_values_videos"], stock["pixel_values_videos"], rtol=0, atol=1e-6)

    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl)
    positions, _ = model.model.get_rope_index(
        stock["input_ids"],
        stock["mm_token_type_ids"],
        video_grid_thw=stock["video_grid_thw"],
        second_per_grid_ts=stock["second_per_grid_ts"],
    )
    assert torch.equal(doc.positions, positions[:, 0])

    # the LLaVA `<video>` placeholders give the same row
    llava = {
        "videos": ["a.mp4", "b.mp4"],
        "conversations": [
            {"from": "human", "value": "<video>and<video>What moves?"},
            {"from": "gpt", "value": "Nothing."},
        ],
    }
    (tmp_path / "data.jsonl").write_text(json.dumps(llava) + "\n")
    row = build_conversation_dataset(tmp_path / "data.jsonl", processor, 512)[0]
    assert row["input_ids"][: len(doc.tokens)].tolist() == doc.tokens
    assert torch.equal(row["position_ids"][1:, : len(doc.tokens)], doc.positions)


@pytest.mark.parametrize(
    ("frames", "height", "width", "fps", "grid"),
    [
        (12, 50, 70, 4, [3, 4, 4]),  # off the 28-pixel grid: rounded to 56x56
        (40, 56, 56, 4, [8, 4, 4]),  # 10 s at 2 fps is 20 frames: data.max_frames=16
        (100, 112, 84, 25, [4, 4, 2]),  # 4 s of 25 fps -> 8 frames; over max_pixels=56x56 a frame: 56x28
        (3, 28, 28, 4, [1, 2, 2]),  # fewer frames than min_frames: 2, a multiple of the temporal patch
    ],
)
def test_frames_and_sizes_are_the_stock_video_processors(frames, height, width, fps, grid, tiny_qwen2_5_vl, tmp_path):
    """Without a video_preprocessor_config.json (as the published Qwen2.5-VL checkpoints) stock reads
    preprocessor_config.json for videos too: each frame under its min/max_pixels. The sampled indices are stock
    `sample_frames`' and the size stock `resize`'s."""
    from transformers.video_utils import VideoMetadata

    processor = processor_of(tiny_qwen2_5_vl, max_frames=16)
    clip = processor.videos.read(noise_video(tmp_path / "v.mp4", frames, height, width, fps, seed=3))
    stock = stock_video_processor(tiny_qwen2_5_vl, max_frames=16)

    sampled = stock.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=2.0).tolist()
    assert clip.metadata.frames_indices == sampled
    assert clip.grid_thw.tolist() == grid
    size = stock_resize(stock, len(sampled), height, width)
    assert grid[1:] == [s // 14 for s in size]
    assert clip.pixel_values.shape == (int(clip.grid_thw.prod()), 3 * 2 * 14 * 14)


SMALL = {"size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}}


@pytest.mark.parametrize(
    ("video_config", "options", "grid"),
    [
        ({"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28}}, {}, [3, 2, 2]),  # its own, smaller size
        ({}, {}, [3, 24, 24]),  # no size in it: the class default, at least 128 x 28 x 28 pixels a frame
        ({**SMALL, "min_frames": 8}, {}, [4, 4, 4]),  # its min_frames
        ({**SMALL, "cap_pixels_per_frame": True, "max_video_tokens": 2}, {}, [3, 2, 2]),  # the reference cap
        (None, {"max_pixels": 28 * 28}, [3, 2, 2]),  # data.max_pixels overrides the (fallback) video size too
    ],
)
def test_the_video_config_is_read_as_stock_reads_it(video_config, options, grid, tiny_qwen2_5_vl, tmp_path):
    """A checkpoint's own video_preprocessor_config.json (size, min_frames, per-frame cap), or
    preprocessor_config.json without one, as stock loads and applies them: 12 frames of 112x112 at 4 fps,
    sampled at 2 fps."""
    from transformers.video_utils import VideoMetadata

    model = shutil.copytree(tiny_qwen2_5_vl, tmp_path / "model")
    if video_config is not None:
        geometry = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
        fields = {"video_processor_type": "Qwen2VLVideoProcessor", **geometry, **video_config}
        (model / "video_preprocessor_config.json").write_text(json.dumps(fields))
    clip = processor_of(model, **options).videos.read(noise_video(tmp_path / "v.mp4", 12, 112, 112, fps=4, seed=4))
    assert clip.grid_thw.tolist() == grid

    stock = type(stock_video_processor(model, max_frames=16)).from_pretrained(model, max_frames=16, **options)
    sampled = stock.sample_frames(VideoMetadata(total_num_frames=12, fps=4), fps=2.0).tolist()
    assert clip.metadata.frames_indices == sampled
    assert grid == [-(-len(sampled) // 2), *(s // 14 for s in stock_resize(stock, len(sampled), 112, 112))]


def test_too_few_frames_name_the_video_and_the_fix(tiny_qwen2_5_vl, tmp_path):
    one = noise_video(tmp_path / "one.mp4", 1, 28, 28, fps=4, seed=5)
    with pytest.raises(ValueError, match=r"video .*one\.mp4 has 1 frames; at least 2 are needed"):
        processor_of(tiny_qwen2_5_vl).video(one)
    four = noise_video(tmp_path / "four.mp4", 4, 28, 28, fps=4, seed=5)
    with pytest.raises(ValueError, match=r"data\.max_frames=1 samples no frame of video .*four\.mp4: set it to at"):
        processor_of(tiny_qwen2_5_vl, max_frames=1).video(four)
