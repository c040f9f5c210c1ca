"""Videos as Qwen3-VL's processor makes them, without torchvision.

Qwen3-VL's stock `Qwen3VLVideoProcessor` samples frames by its own rule (`sample_frames`: `fps` frames a
second, at least `min_frames`, at most `max_frames`, spread evenly with `linspace`), resizes the whole clip to
one size under the video processor's own pixel budget (`smart_resize` over frames x height x width with its
`size`, which is not the image processor's), and patches it like Qwen2-VL. `Qwen3VLProcessor` then writes
each temporal patch's timestamp into the text: the chat template's `<|video_pad|>` becomes
`<{t:.1f} seconds><|vision_start|><|video_pad|> * n<|vision_end|>` per temporal patch (the template's own
`<|vision_start|>`/`<|vision_end|>` around it stay, as stock keeps them), and the model's `get_rope_index`
splits the video's grid into one grid per patch, so its positions need no seconds per grid.

The stock video processor's config, frame sampling and clip-wide `smart_resize` run as they are; decoding,
resizing and patching are spindle.data.stock_video's (`VideoClips`), which Qwen2.5-VL's videos share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.data.stock_video import Clip, VideoClips


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


class TimestampedVideos(VideoClips):
    """A checkpoint's Qwen3-VL video processing: a video file -> `Clip` (`read`), its temporal patches' times
    (`timestamps`), and the text its pad token becomes (`text`). `options`: data.fps and data.max_frames."""

    def __init__(self, model_path: str | Path, image_processor: Any, tokenizer: Any, config: Any, options: Any):
        super().__init__(model_path, image_processor, options)
        # the tokens around each temporal patch (the processor's vision_start_token / vision_end_token)
        self.start, self.end = tokenizer.convert_ids_to_tokens(
            [config.vision_start_token_id, config.vision_end_token_id]
        )

    @staticmethod
    def processor_class() -> Any:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        return Qwen3VLVideoProcessor

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        return clip_size(self.video_processor, frames, height, width)

    def text(self, timestamps: list[float], frame: str) -> str:
        """What the template's video pad token becomes (`Qwen3VLProcessor.replace_video_token`): per temporal
        patch its timestamp, then `frame` (the patch's pad tokens) between the vision start and end tokens."""
        return "".join(f"<{t:.1f} seconds>{self.start}{frame}{self.end}" for t in timestamps)

    def timestamps(self, clip: Clip) -> list[float]:
        """Each temporal patch's time in seconds (what `text` writes)."""
        meta = clip.metadata
        return frame_timestamps(meta.frames_indices, meta.fps, int(self.video_processor.temporal_patch_size))
