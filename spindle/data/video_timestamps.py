"""Videos as Qwen3-VL's processor makes them, without torchvision.

Qwen3-VL's stock `Qwen3VLVideoProcessor` samples frames by its own rule (`sample_frames`: `fps` frames a
second, at least `min_frames`, at most `max_frames`, spread evenly with `linspace`), resizes the whole clip to
one size under the video processor's own pixel budget (`smart_resize` over frames x height x width with its
`size`, which is not the image processor's), and patches it like Qwen2-VL. `Qwen3VLProcessor` then writes
each temporal patch's timestamp into the text: the chat template's `<|video_pad|>` becomes
`<{t:.1f} seconds><|vision_start|><|video_pad|> * n<|vision_end|>` per temporal patch (the template's own
`<|vision_start|>`/`<|vision_end|>` around it stay, as stock keeps them), and the model's `get_rope_index`
splits the video's grid into one grid per patch, so its positions need no seconds per grid.

The stock video processor class loads without torchvision (its config: `video_preprocessor_config.json`,
else `preprocessor_config.json`, as stock falls back), and its `sample_frames`, `smart_resize` and the
processor's `_calculate_timestamps` run here as they are. What needs torchvision is replaced: frames are
decoded with PyAV (spindle.data.media), resized with PIL (bicubic, how the image processor resizes images
here) to stock's size, then rescaled, normalised and patched by `frame_patches`
(spindle.data.video_patches) with the video processor's mean, std and rescale factor. Sizes, grids,
timestamps and tokens are stock's; pixel values are stock's where the frames are already at size, and differ
by resampling rounding (PIL against torchvision) where they are resized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_FPS = 24.0  # what the stock processor assumes for a video whose container gives no frame rate


def stock_video_processor(model_path: str | Path, max_frames: int) -> Any:
    """transformers' Qwen3-VL video processor of the checkpoint, capped at `max_frames` (data.max_frames)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor.from_pretrained(model_path, max_frames=max_frames)


def clip_size(video_processor: Any, frames: int, height: int, width: int) -> tuple[int, int]:
    """The (height, width) stock resizes a clip of `frames` sampled frames to (`Qwen3VLVideoProcessor.resize`:
    its `smart_resize` over the whole clip, with the per-frame cap when `cap_pixels_per_frame` is set)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    vp = video_processor
    factor = vp.patch_size * vp.merge_size
    max_pixels = vp.size.longest_edge
    if vp.cap_pixels_per_frame:  # the reference (qwen-vl-utils) cap, as stock's resize applies it
        per_frame = max(
            min(vp.max_video_tokens * factor * factor, max_pixels // frames), int(vp.size.shortest_edge * 1.05)
        )
        max_pixels = per_frame * frames
    height_bar, width_bar = smart_resize(
        frames,
        height,
        width,
        temporal_factor=vp.temporal_patch_size,
        factor=factor,
        min_pixels=vp.size.shortest_edge,
        max_pixels=max_pixels,
    )
    return int(height_bar), int(width_bar)


def frame_timestamps(indices: list[int], video_fps: float, temporal_patch: int) -> list[float]:
    """Each temporal patch's time in seconds: the stock processor's `_calculate_timestamps` (the mean of the
    patch's first and last frame times)."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    # an unbound call: the method reads nothing of the processor
    times: list[float] = Qwen3VLProcessor._calculate_timestamps(None, list(indices), video_fps, temporal_patch)
    return times


class TimestampedVideos:
    """A checkpoint's Qwen3-VL video processing: a video file -> (pixel_values, grid_thw, timestamps)
    (`read`), and the text its pad token becomes (`text`). `options`: data.fps and data.max_frames."""

    def __init__(self, model_path: str | Path, image_processor: Any, tokenizer: Any, config: Any, options: Any):
        self.video_processor = stock_video_processor(model_path, options.max_frames)
        self.image_processor, self.fps = image_processor, options.fps
        # the tokens around each temporal patch (the processor's vision_start_token / vision_end_token)
        self.start, self.end = tokenizer.convert_ids_to_tokens(
            [config.vision_start_token_id, config.vision_end_token_id]
        )
        vp, ip = self.video_processor, image_processor
        differ = [
            k for k in ("patch_size", "temporal_patch_size", "merge_size") if int(getattr(vp, k)) != int(getattr(ip, k))
        ]
        if differ:  # frames are patched by the image processor: its patch geometry must be the video's
            from spindle.data.text import TextDataError

            raise TextDataError(
                f"{model_path}: the video processor's {', '.join(differ)} differ from the image processor's "
                "(video_preprocessor_config.json against preprocessor_config.json); make them equal"
            )

    def text(self, timestamps: list[float], frame: str) -> str:
        """What the template's video pad token becomes (`Qwen3VLProcessor.replace_video_token`): per temporal
        patch its timestamp, then `frame` (the patch's pad tokens) between the vision start and end tokens."""
        return "".join(f"<{t:.1f} seconds>{self.start}{frame}{self.end}" for t in timestamps)

    def read(self, path: Path) -> tuple[Any, Any, list[float]]:
        """-> (pixel_values [patches, C * tp * p * p], grid_thw [3], each temporal patch's time in seconds);
        a missing, undecodable or too short video is a ValueError naming it."""
        from PIL import Image
        from transformers.video_utils import VideoMetadata

        from spindle.data.media import MediaError, decode_frames, probe_video
        from spindle.data.video_patches import frame_patches

        if not path.is_file():
            raise ValueError(f"video {path} not found")
        vp = self.video_processor
        try:
            total, video_fps, width, height = probe_video(path)
            video_fps = video_fps or DEFAULT_FPS
            metadata = VideoMetadata(total_num_frames=total, fps=video_fps, width=width, height=height)
            indices = [int(i) for i in vp.sample_frames(metadata, fps=self.fps)]
            frames = decode_frames(path, indices)
        except MediaError as e:
            raise ValueError(f"video {path} cannot be decoded ({e})") from None
        tp = int(vp.temporal_patch_size)
        if len(frames) < tp:
            raise ValueError(f"video {path} has {total} frames; at least {tp} are needed")
        size_hw = clip_size(vp, len(frames), height, width)
        resample = Image.Resampling(int(vp.resample))
        frames = [f if f.size == size_hw[::-1] else f.resize(size_hw[::-1], resample) for f in frames]
        pixel_values, grid = frame_patches(
            frames,
            self.image_processor,
            do_resize=False,
            do_rescale=vp.do_rescale,
            rescale_factor=vp.rescale_factor,
            do_normalize=vp.do_normalize,
            image_mean=list(vp.image_mean),
            image_std=list(vp.image_std),
        )
        return pixel_values, grid, frame_timestamps(indices, video_fps, tp)
