"""Video frames -> Qwen-VL vision patches without torchvision.

transformers' Qwen-VL video processors need torchvision (which has no build for the local CPU torch), so
their patching is reproduced with the image processor: each frame (already at the size stock resizes it to,
spindle.data.stock_video) is rescaled and normalised by the model's image processor (PIL) with the video
processor's options, and consecutive frames are stacked along the temporal patch axis in the video
processor's patch order (grid_t, h-blocks, w-blocks, merge rows, merge columns, channel, temporal, patch
rows, patch columns). For a still frame repeated over the temporal patch this is exactly the image
processor's output (tests/data/test_vlm_data.py proves it).
"""

from __future__ import annotations

from typing import Any

import torch


def frame_patches(frames: list[Any], image_processor: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Frames (PIL, same size) -> (pixel_values [grid_t*gh*gw, C*tp*p*p], grid_thw [3]). `kwargs`: the image
    processor's call options (no resize, the video processor's rescale, mean and std)."""
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
