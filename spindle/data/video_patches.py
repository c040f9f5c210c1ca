"""Videos -> Qwen-VL vision patches without torchvision.

transformers' Qwen-VL video processor needs torchvision (which has no build for the local CPU torch), so
this reproduces it with the image processor: frames are sampled as its `sample_frames` does with `fps`
(`min_frames`..`max_frames`, rounded down to a multiple of the temporal patch), each frame is resized,
rescaled and normalised by the model's image processor (PIL), and consecutive frames are stacked along
the temporal patch axis in the video processor's patch order (grid_t, h-blocks, w-blocks, merge rows,
merge columns, channel, temporal, patch rows, patch columns). For a still frame repeated over the
temporal patch this is exactly the image processor's output (tests/data/test_vlm_data.py proves it).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

MIN_FRAMES = 4  # the stock Qwen2-VL video processor's min_frames


def sample_indices(total: int, video_fps: float, fps: float, max_frames: int, temporal_patch: int) -> list[int]:
    """Frame indices sampled at `fps` (the stock `Qwen2VLVideoProcessor.sample_frames` rule)."""
    cap = math.floor(min(max_frames, total) / temporal_patch) * temporal_patch
    wanted = min(max(total / video_fps * fps, MIN_FRAMES), cap, total)
    n = math.floor(wanted / temporal_patch) * temporal_patch
    if n < temporal_patch:
        raise ValueError(f"the video has {total} frames; at least {temporal_patch} are needed")
    return [int(i) for i in torch.arange(0, total, total / n).int().tolist()]


def frame_patches(frames: list[Any], image_processor: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames (PIL, same size) -> (pixel_values [grid_t*gh*gw, C*tp*p*p], grid_thw [3]). `kwargs`: the image
    processor's call options (Qwen3-VL: no resize, the video processor's mean and std)."""
    tp, p = int(image_processor.temporal_patch_size), int(image_processor.patch_size)
    if pad := -len(frames) % tp:  # the stock processor repeats the last frame
        frames = frames + [frames[-1]] * pad
    per_frame = []
    grid = None
    for frame in frames:
        out = image_processor(images=[frame], return_tensors="pt", **kwargs)
        grid = out["image_grid_thw"][0]
        # The image processor repeats a still over the temporal axis; keep one copy: [N, C, p, p].
        per_frame.append(out["pixel_values"].view(grid[1] * grid[2], -1, tp, p, p)[:, :, 0])
    assert grid is not None
    steps = [torch.stack(per_frame[t : t + tp], dim=2) for t in range(0, len(frames), tp)]  # [N, C, tp, p, p]
    pixel_values = torch.cat([s.flatten(1) for s in steps])
    return pixel_values, torch.tensor([len(steps), int(grid[1]), int(grid[2])])


def read_video_patches(
    path: Path, image_processor: Any, fps: float, max_frames: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A video file -> (pixel_values, grid_thw, seconds per temporal grid step)."""
    from spindle.data.media import MediaError, decode_frames, probe_video

    if not path.is_file():
        raise ValueError(f"video {path} not found")
    try:
        total, video_fps, _, _ = probe_video(path)
        tp = int(image_processor.temporal_patch_size)
        indices = sample_indices(total, video_fps or fps, fps, max_frames, tp)
        frames = decode_frames(path, indices)
    except MediaError as e:
        raise ValueError(f"video {path} cannot be decoded ({e})") from None
    pixel_values, grid = frame_patches(frames, image_processor)
    sampled_fps = len(indices) / total * (video_fps or fps)
    return pixel_values, grid, tp / sampled_fps
