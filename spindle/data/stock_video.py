"""Videos sampled and sized by the checkpoint's stock Qwen-VL video processor, without torchvision.

transformers' Qwen-VL video processors (`Qwen2VLVideoProcessor` for Qwen2.5-VL and the Qwen-Omni thinkers,
`Qwen3VLVideoProcessor` for Qwen3-VL) run on torchvision, which Spindle does not use. Their configuration and
their rules do not need it: the class loads the checkpoint's `video_preprocessor_config.json` (else
`preprocessor_config.json`, as stock falls back: the published Qwen2.5-VL checkpoints ship no video config, so
their videos take the image processor's `min_pixels` / `max_pixels`), its `sample_frames` picks the frames
(`data.fps` frames a second, at least `min_frames`, at most `data.max_frames`) and its `smart_resize` the
size. What needs torchvision is replaced: frames are decoded with PyAV (spindle.data.media; its frame count is
the container's `stream.frames`, as stock's PyAV reader takes it, counted by demuxing only where the container
gives none), resized with PIL (the video processor's resample, bicubic) to stock's size, then rescaled,
normalised and patched by `frame_patches` (spindle.data.video_patches) with the video processor's mean, std
and rescale factor. Sizes, frame choices and grids are stock's; pixel values are stock's where the frames are
already at size, and differ by resampling rounding (PIL against torchvision) where they are resized.

`VideoClips` is the shared reader; `Qwen2VLVideos` sizes each frame as `Qwen2VLVideoProcessor.resize` does;
Qwen3-VL's clip-wide size and timestamps are spindle.data.video_timestamps.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_FPS = 24.0  # what the stock processors assume for a video whose container gives no frame rate
TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.v2",
    "torchvision.transforms.v2.functional",
)


def qwen2_vl_video_processor_class() -> Any:
    """transformers' `Qwen2VLVideoProcessor`. Its module imports torchvision's functional transforms at the
    top but only resizing uses them (and string annotations name them); Spindle never calls that resize, so
    without torchvision the module is imported against a stand-in that raises if anything did use it."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():  # also fixes transformers' cached answer before any stand-in exists
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return Qwen2VLVideoProcessor
    name = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    if name not in sys.modules:
        import importlib

        import transformers.image_processing_backends  # noqa: F401  # imported before the stand-in exists

        class Absent(types.ModuleType):
            def __getattr__(self, attr: str) -> Any:
                raise ModuleNotFoundError(f"torchvision is not installed (Qwen2VLVideoProcessor needed .{attr})")

        stand_ins = {m: Absent(m) for m in TORCHVISION_MODULES}
        for full, module in stand_ins.items():  # `import a.b.c as x` reads each package's submodule attribute
            parent, _, child = full.rpartition(".")
            if parent:
                vars(stand_ins[parent])[child] = module
        assert not set(stand_ins) & set(sys.modules)
        sys.modules.update(stand_ins)
        try:
            importlib.import_module(name)
        finally:
            for m in stand_ins:
                del sys.modules[m]
    return sys.modules[name].Qwen2VLVideoProcessor


@dataclass
class Clip:
    """One video as the vision tower takes it, with the stock metadata of its sampled frames."""

    pixel_values: torch.Tensor  # [patches, C * temporal_patch * patch * patch]
    grid_thw: torch.Tensor  # [3]
    metadata: Any  # transformers' VideoMetadata: frame count, fps, size and the sampled `frames_indices`


class VideoClips:
    """A checkpoint's stock video processor (`self.video_processor`, its config with `data.max_frames` and
    `overrides`) and the reader that follows it: a video file -> `Clip` (`read`). Subclasses say which
    processor class (`processor_class`) and how a clip is sized (`size`)."""

    def __init__(self, model_path: str | Path, image_processor: Any, options: Any, **overrides: Any):
        self.video_processor = self.processor_class().from_pretrained(
            model_path, max_frames=options.max_frames, **overrides
        )
        self.image_processor, self.fps = image_processor, options.fps
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

    @staticmethod
    def processor_class() -> Any:
        raise NotImplementedError

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) stock resizes `frames` sampled frames of `height` x `width` to."""
        raise NotImplementedError

    def sample(self, metadata: Any, path: Path) -> list[int]:
        """The frame indices stock samples (its `sample_frames` at `data.fps`)."""
        return [int(i) for i in self.video_processor.sample_frames(metadata, fps=self.fps)]

    def read(self, path: Path) -> Clip:
        """A missing, undecodable or too short video is a ValueError naming it."""
        from PIL import Image
        from transformers.video_utils import VideoMetadata

        from spindle.data.media import MediaError, decode_frames, probe_video
        from spindle.data.video_patches import frame_patches

        if not path.is_file():
            raise ValueError(f"video {path} not found")
        vp = self.video_processor
        tp = int(vp.temporal_patch_size)
        try:
            total, video_fps, width, height = probe_video(path)
            metadata = VideoMetadata(total_num_frames=total, fps=video_fps or DEFAULT_FPS, width=width, height=height)
            metadata.frames_indices = self.sample(metadata, path)
            frames = decode_frames(path, metadata.frames_indices)
        except MediaError as e:
            raise ValueError(f"video {path} cannot be decoded ({e})") from None
        if len(frames) < tp:
            raise ValueError(f"video {path} has {total} frames; at least {tp} are needed")
        size_wh = self.size(len(frames), height, width)[::-1]
        resample = Image.Resampling(int(vp.resample))
        frames = [f if f.size == size_wh else f.resize(size_wh, resample) for f in frames]
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
        return Clip(pixel_values, grid, metadata)


class Qwen2VLVideos(VideoClips):
    """Qwen2.5-VL's and the Qwen-Omni thinkers' videos (`Qwen2VLVideoProcessor`): each frame sized by
    `smart_resize` under the video processor's per-frame `size` (`data.min_pixels` / `data.max_pixels`, when
    set, override it: the processor's own `min_pixels` / `max_pixels` keywords, which mean per frame here as
    per image), with the reference per-frame cap when its config sets `cap_pixels_per_frame`."""

    def __init__(self, model_path: str | Path, image_processor: Any, options: Any):
        pixels = {k: v for k, v in (("min_pixels", options.min_pixels), ("max_pixels", options.max_pixels)) if v}
        super().__init__(model_path, image_processor, options, **pixels)

    @staticmethod
    def processor_class() -> Any:
        return qwen2_vl_video_processor_class()

    def sample(self, metadata: Any, path: Path) -> list[int]:
        tp, cap = int(self.video_processor.temporal_patch_size), int(self.video_processor.max_frames)
        if metadata.total_num_frames < tp:  # stock's sample_frames would take no frame (and divide by zero)
            raise ValueError(f"video {path} has {metadata.total_num_frames} frames; at least {tp} are needed")
        if cap < tp:
            raise ValueError(f"data.max_frames={cap} samples no frame of video {path}: set it to at least {tp}")
        return super().sample(metadata, path)

    def size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """`Qwen2VLVideoProcessor.resize`'s size (its module's `smart_resize`)."""
        vp = self.video_processor
        smart_resize = sys.modules[type(vp).__module__].smart_resize
        factor = vp.patch_size * vp.merge_size
        max_pixels = vp.size.longest_edge
        if vp.cap_pixels_per_frame:  # an even share of 90% of max_video_tokens, as stock's resize caps it
            total_pixels = int(vp.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(
                min(max_pixels, total_pixels * vp.temporal_patch_size // frames), int(vp.size.shortest_edge * 1.05)
            )
        h, w = smart_resize(height, width, factor=factor, min_pixels=vp.size.shortest_edge, max_pixels=max_pixels)
        return int(h), int(w)

    def second_per_grid(self, clip: Clip, per: str) -> float:
        """Seconds per temporal grid step, as the family's stock processor computes it (`per`):
        "sampled_fps": temporal patch / the clip's sampled frame rate (`Qwen2_5_VLProcessor`: the sampled
        frames over the clip's frames times its fps); "fps": temporal patch / `data.fps` (the Qwen-Omni
        processors, whatever was sampled)."""
        fps = clip.metadata.sampled_fps if per == "sampled_fps" else self.fps
        return float(self.video_processor.temporal_patch_size / fps)
