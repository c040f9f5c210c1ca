"""Decode training media (video via PyAV, images via Pillow) and encode results (mp4 / png).

Every sample becomes a float32 tensor [C=3, F, H, W] in [-1, 1], the layout diffusers VAEs take
(batched to [B, 3, F, H, W] by the collate). Frames are resized so the short side covers the target
and center-cropped, by one shared function (`resize_center_crop`), so videos and images are
preprocessed identically.

Frame sampling (`sample_frame_indices`): `num_frames` evenly spaced indices over the whole clip,
rounded to the nearest frame. When the clip is shorter than `num_frames`, the same rule repeats
frames evenly (each source frame about num_frames/len times, in order) instead of freezing on the
last frame: the motion is slowed down but still spans the clip, so the model never sees a clip that
stops moving halfway through.
"""

from __future__ import annotations

import functools
import os
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image, ImageOps

VIDEO_EXTENSIONS = frozenset({".mp4", ".webm", ".mov", ".mkv", ".avi", ".gif", ".m4v"})
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp"})
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS | IMAGE_EXTENSIONS

# Containers write_video can produce with an H.264 (or MPEG-4 part 2) stream, by file suffix.
_WRITE_CONTAINERS = {".mp4": "mp4", ".mov": "mov", ".mkv": "matroska", ".m4v": "mp4"}

_SKIP_HINT = "Fix or remove the file, or set data.skip_bad_samples=true to skip bad samples."


class MediaError(ValueError):
    """A media file that cannot be used: the message names the file, the problem and the fix."""

    def __init__(self, path: str | os.PathLike[str], problem: str, hint: str = _SKIP_HINT):
        self.path = Path(path)
        self.problem = problem
        self.hint = hint
        super().__init__(f"{self.path}: {problem}. {hint}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions cross process boundaries (DataLoader workers) by pickling; the default
        # reduce would call __init__ with the formatted message as the only argument.
        return (type(self), (self.path, self.problem, self.hint))


def is_video_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in VIDEO_EXTENSIONS


def is_image_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def is_media_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in MEDIA_EXTENSIONS


# ----------------------------------------------------------------------------- preprocessing


def _check_resolution(resolution: tuple[int, int]) -> tuple[int, int]:
    height, width = (int(v) for v in resolution)
    if height <= 0 or width <= 0:
        raise ValueError(f"resolution must be (height, width) with positive sizes; got {resolution}")
    return height, width


def resize_center_crop(img: Image.Image, resolution: tuple[int, int]) -> Image.Image:
    """Resize keeping the aspect ratio so the image covers `resolution` = (H, W), then center-crop.

    Covering (not fitting) means no padding ever enters the training data; the cost is losing the
    borders of the long side. Bicubic resampling; Pillow filters over the source footprint when
    downscaling, so it is antialiased.
    """
    height, width = _check_resolution(resolution)
    src_w, src_h = img.size
    scale = max(height / src_h, width / src_w)
    # round() then max() so float error can never leave the resized side 1 px short of the target.
    new_w = max(width, round(src_w * scale))
    new_h = max(height, round(src_h * scale))
    if (new_w, new_h) != (src_w, src_h):
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left = (new_w - width) // 2
    top = (new_h - height) // 2
    return img.crop((left, top, left + width, top + height))


def _to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB; transparent pixels are composited over white, not left undefined."""
    if img.mode == "RGB":
        return img
    has_alpha = img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info)
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def frames_to_tensor(frames: list[Image.Image]) -> torch.Tensor:
    """RGB PIL frames of equal size -> float32 [3, F, H, W] in [-1, 1]."""
    array = np.stack([np.asarray(f, dtype=np.uint8) for f in frames])  # [F, H, W, 3]
    tensor = torch.from_numpy(array).permute(3, 0, 1, 2).float()
    return tensor.div_(127.5).sub_(1.0)


def tensor_to_image(frame: torch.Tensor) -> Image.Image:
    """A [3, H, W] frame in [-1, 1] (as `frames_to_tensor` decodes uint8 pixels) -> the uint8 RGB image it
    came from (exact: the rounding undoes the float arithmetic). What a user would pass as an input image."""
    array = ((frame.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(np.ascontiguousarray(array.permute(1, 2, 0).numpy()))


def sample_frame_indices(total: int, num_frames: int) -> list[int]:
    """`num_frames` evenly spaced indices in [0, total), repeating frames when total < num_frames."""
    if total <= 0:
        raise ValueError(f"cannot sample from a clip with {total} frames")
    if num_frames <= 0:
        raise ValueError(f"num_frames must be positive; got {num_frames}")
    return [int(i) for i in np.linspace(0, total - 1, num_frames).round()]


# ----------------------------------------------------------------------------- decoding


def _check_readable(path: Path) -> None:
    if not path.exists():
        raise MediaError(path, "file does not exist", "Check the dataset path or manifest entry.")
    if not path.is_file():
        raise MediaError(path, "not a regular file", "Point the dataset at media files only.")


def _open_video(path: Path) -> Any:
    """Open a container and return (container, its first video stream); MediaError if impossible."""
    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError) as exc:
        raise MediaError(path, f"unreadable video ({exc.__class__.__name__}: {exc})") from exc
    if not container.streams.video:
        container.close()
        raise MediaError(path, "no video stream in the file")
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"  # frame/slice threads: large speed-up, same decoded pixels
    return container, stream


def _count_frames(path: Path) -> int:
    """Frame count from the container header, or by demuxing (no decode) when the header omits it."""
    container, stream = _open_video(path)
    try:
        if stream.frames > 0:
            return int(stream.frames)
        # webm/mkv/gif often carry no frame count; one packet per frame for video streams.
        return sum(1 for packet in container.demux(stream) if packet.size > 0)
    except av.FFmpegError as exc:
        raise MediaError(path, f"corrupt video stream ({exc})") from exc
    finally:
        container.close()


def _decode_selected(path: Path, indices: list[int], resolution: tuple[int, int]) -> tuple[dict[int, Image.Image], int]:
    """Decode frames in order, keeping (resized) only the wanted ones; returns them and how many
    frames were decoded. Stops early once the last wanted frame is reached."""
    wanted = set(indices)
    last = max(indices)
    kept: dict[int, Image.Image] = {}
    decoded = 0
    container, stream = _open_video(path)
    try:
        for i, frame in enumerate(container.decode(stream)):
            decoded = i + 1
            if i in wanted:
                kept[i] = resize_center_crop(frame.to_image(), resolution)
            if i >= last:
                break
    except av.FFmpegError as exc:
        if not kept:
            raise MediaError(path, f"corrupt video stream ({exc})") from exc
        # A truncated tail: use what decoded; the caller resamples over the real length.
    finally:
        container.close()
    return kept, decoded


def read_video(path: str | os.PathLike[str], num_frames: int, resolution: tuple[int, int]) -> torch.Tensor:
    """Decode `num_frames` evenly spaced frames -> float32 [3, num_frames, H, W] in [-1, 1].

    Only the selected frames are converted and resized, so long clips cost one decode pass and
    `num_frames` resizes, never a full clip in memory.
    """
    path = Path(path)
    _check_readable(path)
    _check_resolution(resolution)
    total = _count_frames(path)
    if total == 0:
        raise MediaError(path, "the video has zero frames")
    indices = sample_frame_indices(total, num_frames)
    kept, decoded = _decode_selected(path, indices, resolution)
    if len(kept) < len(set(indices)):
        # The header over-stated the length (or the tail is corrupt): resample over what decodes.
        if decoded == 0:
            raise MediaError(path, "the video has zero decodable frames")
        indices = sample_frame_indices(decoded, num_frames)
        kept, _ = _decode_selected(path, indices, resolution)
        if len(kept) < len(set(indices)):
            raise MediaError(path, "frames could not be decoded consistently")
    return frames_to_tensor([kept[i] for i in indices])


# How many times `max_pixels` an image may hold when it is decoded in full (`load_image`): decoding memory is
# then bounded by the pixels the model is given. 64 = 8 x 8: JPEG's draft mode decodes at down to 1/8 a side,
# so a bigger JPEG is decoded reduced to within it; other formats (PNG, WebP, BMP) have no reduced decode.
DECODE_FACTOR = 64


def load_image(path: str | os.PathLike[str], max_pixels: int | None = None) -> Image.Image:
    """The decoded image (its own mode), a bad file a MediaError naming it: not an image, truncated, or over
    Pillow's decompression-bomb limit (checked from the header, before decoding).

    `max_pixels` (the pixels the model takes of an image, e.g. `data.max_pixels`) bounds the decode: an image
    within `DECODE_FACTOR` times it decodes in full, exactly as a plain `Image.open(...).load()`; a bigger JPEG
    decodes reduced by its draft mode (to at least 4 x `max_pixels`, so the resize after it still downscales);
    any other image bigger than that is an error naming the bound, before its pixels are decoded."""
    path = Path(path)
    _check_readable(path)
    try:
        with Image.open(path) as img:
            width, height = img.size
            if max_pixels is not None and width * height > (bound := max_pixels * DECODE_FACTOR):
                scale = (4 * max_pixels / (width * height)) ** 0.5
                img.draft("RGB", (max(1, int(width * scale)), max(1, int(height * scale))))  # JPEG only; else a no-op
                if img.size[0] * img.size[1] > bound:
                    raise MediaError(
                        path,
                        f"{width}x{height} = {width * height} pixels is more than {DECODE_FACTOR} x data.max_pixels "
                        f"({max_pixels}) = {bound}, what is decoded in full to be resized down",
                        "Downscale the file, raise data.max_pixels, or set data.skip_bad_samples=true to skip it.",
                    )
            img.load()
            return img
    except Image.DecompressionBombError as exc:  # not an OSError: raised from the header, nothing decoded
        raise MediaError(
            path,
            f"{exc} (over Pillow's decompression-bomb limit)",
            "Downscale the file, or set data.skip_bad_samples=true to skip it.",
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, MediaError):
            raise
        # Pillow raises UnidentifiedImageError (an OSError) for non-images, OSError for truncated
        # files, and SyntaxError/ValueError from some plugin parsers.
        raise MediaError(path, f"unreadable image ({exc.__class__.__name__}: {exc})") from exc


def read_image(path: str | os.PathLike[str], resolution: tuple[int, int]) -> torch.Tensor:
    """Load an image (any mode; EXIF orientation applied) -> float32 [3, 1, H, W] in [-1, 1]."""
    _check_resolution(resolution)
    rgb = _to_rgb(ImageOps.exif_transpose(load_image(path)))
    return frames_to_tensor([resize_center_crop(rgb, resolution)])


def read_media(path: str | os.PathLike[str], num_frames: int, resolution: tuple[int, int]) -> torch.Tensor:
    """Dispatch on the extension. Videos give [3, num_frames, H, W]; images always give
    [3, 1, H, W] whatever `num_frames` is: whether and how a still becomes a clip is the model
    family's decision (Wan accepts 1 frame since it takes 4k+1), not the decoder's."""
    path = Path(path)
    if is_video_path(path):
        return read_video(path, num_frames, resolution)
    if is_image_path(path):
        return read_image(path, resolution)
    raise MediaError(
        path,
        f"unsupported extension {path.suffix!r}",
        f"Supported: {', '.join(sorted(MEDIA_EXTENSIONS))}. Convert the file or remove it from the dataset.",
    )


def decode_frames(path: str | os.PathLike[str], indices: list[int]) -> list[Image.Image]:
    """The frames at `indices` (sorted, unique), RGB at the video's own size, in one decode pass."""
    path = Path(path)
    _check_readable(path)
    wanted, kept = set(indices), {}
    container, stream = _open_video(path)
    try:
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                kept[i] = _to_rgb(frame.to_image())
            if i >= max(indices):
                break
    except av.FFmpegError as exc:
        raise MediaError(path, f"corrupt video stream ({exc})") from exc
    finally:
        container.close()
    if len(kept) < len(wanted):
        raise MediaError(path, f"only {len(kept)} of the {len(wanted)} sampled frames could be decoded")
    return [kept[i] for i in indices]


def probe_video(path: str | os.PathLike[str]) -> tuple[int, float, int, int]:
    """(num_frames, fps, width, height) of a video's first video stream, without decoding it."""
    path = Path(path)
    _check_readable(path)
    total = _count_frames(path)
    container, stream = _open_video(path)
    try:
        rate = stream.average_rate or stream.guessed_rate or 0
        return total, float(rate), int(stream.codec_context.width), int(stream.codec_context.height)
    finally:
        container.close()


# ----------------------------------------------------------------------------- encoding


def _to_uint8(frames: Any) -> np.ndarray:
    """numpy/torch uint8 (0..255) or floating (0..1, clipped) -> contiguous uint8 numpy array."""
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu()
        if frames.is_floating_point():
            frames = frames.float()
        frames = frames.numpy()
    array = np.asarray(frames)
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        return np.ascontiguousarray((np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8))
    raise TypeError(f"frames must be uint8 (0..255) or floating point (0..1); got dtype {array.dtype}")


def _pad_to_even(frames: np.ndarray) -> np.ndarray:
    """yuv420p subsamples chroma 2x2, so H.264 needs even sizes: replicate the last row/column."""
    _, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    return frames


@functools.lru_cache(maxsize=1)
def video_codec() -> str:
    """libx264 when this PyAV build can encode with it, else FFmpeg's native mpeg4 encoder."""
    for name in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
            return name
        except (av.FFmpegError, ValueError):
            continue
    raise RuntimeError("this PyAV build has neither the libx264 nor the mpeg4 encoder")


def _fps_fraction(fps: int | float | Fraction) -> Fraction:
    rate = Fraction(fps).limit_denominator(1001)
    if rate <= 0:
        raise ValueError(f"fps must be positive; got {fps}")
    return rate


def write_video(
    path: str | os.PathLike[str],
    frames: Any,
    fps: int | float | Fraction = 16,
    crf: int = 18,
    audio: Any = None,
    sample_rate: int | None = None,
) -> Path:
    """Write frames [F, H, W, 3] (uint8 0..255 or float 0..1; numpy or torch) as H.264 yuv420p, with `audio`
    (float [channels, samples] in [-1, 1] at `sample_rate` Hz, one or two channels) as an AAC track.

    Odd heights/widths are padded by one replicated row/column (yuv420p needs even sizes), so the
    file can be one pixel larger than the input. The file is written to a temporary name and
    renamed, so a crash never leaves a truncated video under the final name.

    Not byte-reproducible: identical frames were seen to encode to slightly different files
    (a few levels on edges, ~1 encode in 100 under CPU load, with or without x264 threads).
    Compare decoded pixels with a tolerance, never file hashes.
    """
    path = Path(path)
    container_format = _WRITE_CONTAINERS.get(path.suffix.lower())
    if container_format is None:
        raise ValueError(f"{path}: write_video writes {', '.join(sorted(_WRITE_CONTAINERS))} files")
    array = _to_uint8(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or array.shape[0] == 0:
        raise ValueError(f"{path}: frames must have shape [F>0, H, W, 3]; got {tuple(array.shape)}")
    array = _pad_to_even(array)
    _, height, width, _ = array.shape

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    codec = video_codec()
    rate = _fps_fraction(fps)
    sound = None if audio is None else _audio_planes(audio, sample_rate, path)
    try:
        with av.open(str(tmp), mode="w", format=container_format) as container:
            stream = container.add_stream(codec, rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            if codec == "libx264":
                stream.options = {"crf": str(crf)}
            else:
                stream.bit_rate = 8 * width * height * int(max(1, round(float(rate))))
            # (every stream is added before the first packet: the container writes its header then)
            track = None if sound is None else _audio_stream(container, sound, int(sample_rate or 0))
            for i, image in enumerate(array):
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                frame.pts = i
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))  # flush delayed (B-)frames
            if track is not None and sound is not None:
                _mux_audio(container, track, sound)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _audio_planes(audio: Any, sample_rate: int | None, path: Path) -> np.ndarray:
    """`audio` as float32 planes [channels (1 or 2), samples] clipped to [-1, 1]; a clear error for a bad one."""
    planes = np.asarray(audio.detach().cpu() if hasattr(audio, "detach") else audio, dtype=np.float32)
    if planes.ndim == 1:
        planes = planes[None]
    if planes.ndim != 2 or planes.shape[0] not in (1, 2) or planes.shape[1] == 0:
        raise ValueError(f"{path}: audio must have shape [1 or 2 channels, samples > 0]; got {tuple(planes.shape)}")
    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"{path}: audio needs a positive sample_rate; got {sample_rate!r}")
    return np.ascontiguousarray(np.clip(planes, -1.0, 1.0))


def _audio_stream(container: Any, planes: np.ndarray, sample_rate: int) -> Any:
    """An AAC stream of `planes`' channel count in the open `container`."""
    return container.add_stream("aac", rate=sample_rate, layout="mono" if planes.shape[0] == 1 else "stereo")


def _mux_audio(container: Any, stream: Any, planes: np.ndarray) -> None:
    """`planes` [channels, samples] encoded into `stream` (`_audio_stream`), in encoder-sized frames."""
    layout, sample_rate = stream.layout.name, stream.rate
    size = stream.codec_context.frame_size or 1024
    for start in range(0, planes.shape[1], size):
        frame = av.AudioFrame.from_ndarray(planes[:, start : start + size].copy(), format="fltp", layout=layout)
        frame.sample_rate, frame.pts = sample_rate, start
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def write_image(path: str | os.PathLike[str], frame: Any) -> Path:
    """Write one frame [H, W, 3] or [H, W] (uint8 0..255 or float 0..1) with Pillow; the format
    follows the suffix (png for lossless results)."""
    path = Path(path)
    array = _to_uint8(frame)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] == 3)):
        raise ValueError(f"{path}: frame must have shape [H, W, 3] or [H, W]; got {tuple(array.shape)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
    return path
