"""Training data: media decode/encode (media.py), caption datasets (datasets.py), batching (loader.py)."""

from spindle.data.datasets import MediaDataset, Sample, build_dataset, collate
from spindle.data.loader import ResumableLoader
from spindle.data.media import MediaError, read_image, read_media, read_video, write_image, write_video

__all__ = [
    "MediaDataset",
    "MediaError",
    "ResumableLoader",
    "Sample",
    "build_dataset",
    "collate",
    "read_image",
    "read_media",
    "read_video",
    "write_image",
    "write_video",
]
