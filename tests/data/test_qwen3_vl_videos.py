"""Qwen3-VL video conversations (spindle.data.video_timestamps): the tokens (each temporal patch's timestamp
and pad tokens), pixels, grids and 3-D positions of stock transformers' Qwen3VLProcessor with its
Qwen3VLVideoProcessor and of the stock model's get_rope_index; clips are resized to stock's size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spindle.data.media import write_video
from spindle.data.multimodal import VisionOptions, VisionProcessor, build_conversation_dataset, conversation_document
from spindle.testing.vlm_conformance import stock_video_inputs

FAMILIES = ["qwen3_vl", "qwen3_vl_moe"]


def noise_video(path: Path, frames: int, height: int, width: int, fps: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    write_video(path, rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8), fps=fps)
    return path


def processor_of(model: Path, **options) -> VisionProcessor:
    from transformers import AutoConfig, AutoTokenizer

    from spindle.registry import get_family

    config = AutoConfig.from_pretrained(model)
    family = get_family(config.model_type)
    return VisionProcessor(
        model,
        AutoTokenizer.from_pretrained(model),
        config,
        family.rope_index_fn(),
        VisionOptions(**options),
        video_timestamps=family.video_timestamps,
        video_grid_seconds=family.video_grid_seconds,
    )


def two_video_lines(folder: Path) -> tuple[dict, dict]:
    """The same conversation in the messages and the LLaVA format: a 3 s clip (6 frames sampled at 2 fps: 3
    temporal patches) and a 1 s non-square one (raised to min_frames=4: 2 patches), both at stock's size."""
    noise_video(folder / "a.mp4", 12, 64, 64, fps=4, seed=1)
    noise_video(folder / "b.mp4", 8, 32, 64, fps=8, seed=2)
    messages = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": "a.mp4"},
                    {"type": "text", "text": "and"},
                    {"type": "video", "video": "b.mp4"},
                    {"type": "text", "text": "What moves?"},
                ],
            },
            {"role": "assistant", "content": "Nothing."},
        ]
    }
    llava = {
        "videos": ["a.mp4", "b.mp4"],
        "conversations": [
            {"from": "human", "value": "<video>and<video>What moves?"},
            {"from": "gpt", "value": "Nothing."},
        ],
    }
    return messages, llava


@pytest.mark.parametrize("family", FAMILIES)
def test_video_tokens_pixels_and_positions_equal_stock(family, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForImageTextToText

    model = tiny_checkpoint(family)
    messages, llava = two_video_lines(tmp_path)
    processor = processor_of(model)
    doc, cut = conversation_document(messages, tmp_path, processor, 4096, "x:1")
    stock = stock_video_inputs(model, messages["messages"], tmp_path, max_frames=16)

    assert not cut and stock["input_ids"][0].tolist() == doc.tokens
    text = processor.tokenizer.decode(doc.tokens)
    assert text.count(" seconds><|vision_start|>") == 5 and "<0.2 seconds><|vision_start|><|video_pad|>" in text
    assert [v.grid_thw.tolist() for v in doc.vision] == stock["video_grid_thw"].tolist() == [[3, 4, 4], [2, 2, 4]]
    pixels = torch.cat([v.pixel_values for v in doc.vision])
    torch.testing.assert_close(pixels, stock["pixel_values_videos"], rtol=0, atol=1e-6)

    stock_model = AutoModelForImageTextToText.from_pretrained(model)
    positions, _ = stock_model.model.get_rope_index(
        stock["input_ids"], mm_token_type_ids=stock["mm_token_type_ids"], video_grid_thw=stock["video_grid_thw"]
    )
    assert torch.equal(doc.positions, positions[:, 0])

    # the LLaVA `<video>` placeholders give the same row, with no seconds per grid (the model takes none)
    (tmp_path / "data.jsonl").write_text(json.dumps(llava) + "\n")
    row = build_conversation_dataset(tmp_path / "data.jsonl", processor, 512)[0]
    assert row["input_ids"][: len(doc.tokens)].tolist() == doc.tokens
    assert [v.timestamps for v in row["vision"]] == [v.timestamps for v in doc.vision]


@pytest.mark.parametrize(
    ("frames", "height", "width", "fps", "grid"),
    [
        (12, 50, 70, 4, [3, 4, 4]),  # off the 32-pixel grid: rounded to 64x64
        (40, 96, 96, 4, [8, 4, 4]),  # 10 s -> max_frames=16 of 96x96: over the clip's pixel budget, 64x64
        (3, 64, 64, 4, [2, 4, 4]),  # fewer frames than min_frames: all 3, the last repeated to a full patch
    ],
)
def test_clips_are_sampled_and_resized_to_the_stock_video_processors_size(
    frames, height, width, fps, grid, tiny_checkpoint, tmp_path
):
    """The video processor's own budget (video_preprocessor_config.json, over frames x height x width), not
    the image processor's per-image one: the grid is stock's patch count for the frames it samples."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    model = tiny_checkpoint("qwen3_vl")
    processor = processor_of(model, max_frames=16)
    video = processor.video(noise_video(tmp_path / "v.mp4", frames, height, width, fps, seed=3))
    stock = Qwen3VLVideoProcessor.from_pretrained(model, max_frames=16)
    sampled = stock.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps, width=width, height=height))
    assert video.grid_thw.tolist() == grid
    assert int(video.grid_thw.prod()) == stock.get_num_of_video_patches(len(sampled), height, width)
    assert video.pixel_values.shape == (int(video.grid_thw.prod()), 3 * 2 * 16 * 16)
    times = [(sampled[i] + sampled[min(i + 1, len(sampled) - 1)]) / 2 / fps for i in range(0, len(sampled), 2)]
    assert video.timestamps == pytest.approx(times)


@pytest.mark.parametrize(("cap", "grid"), [(False, [2, 8, 8]), (True, [2, 4, 4])])
def test_the_per_frame_pixel_cap_of_the_video_config_is_applied_as_stock_applies_it(
    cap, grid, tiny_checkpoint, tmp_path
):
    """`cap_pixels_per_frame` (video_preprocessor_config.json): 4 sampled 128x128 frames fit the clip's budget
    (16 x 64 x 64 pixels) uncapped; capped at `max_video_tokens`=4 merged patches a frame they are 64x64."""
    import shutil

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    model = shutil.copytree(tiny_checkpoint("qwen3_vl"), tmp_path / "model")
    config_file = model / "video_preprocessor_config.json"
    config = json.loads(config_file.read_text())
    config.update(cap_pixels_per_frame=cap, max_video_tokens=4)
    config_file.write_text(json.dumps(config))
    video = processor_of(model).video(noise_video(tmp_path / "v.mp4", 8, 128, 128, fps=8, seed=4))
    stock = Qwen3VLVideoProcessor.from_pretrained(model, max_frames=16)
    assert video.grid_thw.tolist() == grid
    assert int(video.grid_thw.prod()) == stock.get_num_of_video_patches(4, 128, 128)


def test_an_undecodable_video_names_the_line(tiny_checkpoint, tmp_path):
    from spindle.data.text import TextDataError

    (tmp_path / "bad.mp4").write_bytes(b"not a video")
    line = {
        "videos": ["bad.mp4"],
        "conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "?"}],
    }
    (tmp_path / "data.jsonl").write_text(json.dumps(line) + "\n")
    with pytest.raises(TextDataError, match=r"data.jsonl:1: video .*bad.mp4 cannot be decoded"):
        build_conversation_dataset(tmp_path / "data.jsonl", processor_of(tiny_checkpoint("qwen3_vl")), 512)
