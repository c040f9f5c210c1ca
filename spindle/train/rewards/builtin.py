"""The built-in rewards for DiT models, offline: DDPO's JPEG compressibility and incompressibility, and a
prompt-image CLIP score from a local transformers CLIP folder. A video's reward is the mean over its frames."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spindle.config import ConfigError
from spindle.train.rewards.images import encode, frames, to_uint8

JPEG_QUALITY = 95  # DDPO's


def jpeg_size_kb(sample: np.ndarray) -> float:
    """The sample's size as a quality-95 JPEG in kB (a video: the mean over its frames)."""
    return float(np.mean([len(encode(f, "JPEG", quality=JPEG_QUALITY)) / 1000 for f in frames(sample)]))


def jpeg_incompressibility(
    images: Sequence[np.ndarray], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
) -> list[float]:
    """DDPO's jpeg_incompressibility: the JPEG size in kB (detail and noise score high)."""
    return [jpeg_size_kb(image) for image in images]


def jpeg_compressibility(
    images: Sequence[np.ndarray], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
) -> list[float]:
    """DDPO's jpeg_compressibility: minus the JPEG size in kB (flat, simple images score high)."""
    return [-jpeg_size_kb(image) for image in images]


class ClipScore:
    """Cosine similarity of CLIP's image and text embeddings (in [-1, 1]), per sample with its prompt; the
    images are quantised to 8 bits and prepared by the folder's own image processor, as CLIP was trained."""

    def __init__(self, folder: str, batch_size: int, device: torch.device) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        path = Path(folder).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"builtin clip_score: clip_model {folder} is not a transformers CLIP folder (no config.json there)"
            )
        self.model = CLIPModel.from_pretrained(path).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.batch_size = batch_size
        self.device = device
        self.max_length = int(self.model.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def __call__(
        self, images: Sequence[np.ndarray], prompts: Sequence[Any], columns: Mapping[str, Sequence[Any]]
    ) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(images), self.batch_size):
            batch = list(range(start, min(start + self.batch_size, len(images))))
            sample_frames = [[to_uint8(f) for f in frames(images[i])] for i in batch]
            flat = [f for fs in sample_frames for f in fs]
            pixels = self.processor(images=flat, return_tensors="pt")["pixel_values"].to(self.device)
            text = self.tokenizer(
                [str(prompts[i]) for i in batch],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            image_emb = _features(self.model.get_image_features(pixel_values=pixels))
            text_emb = _features(self.model.get_text_features(**text))
            image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True)
            text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)
            offset = 0
            for row, fs in enumerate(sample_frames):
                cosine = image_emb[offset : offset + len(fs)] @ text_emb[row]
                scores.append(float(cosine.float().mean()))
                offset += len(fs)
        return scores


def _features(out: Any) -> torch.Tensor:
    """transformers 5 returns a model output from get_*_features where 4.x returned the tensor."""
    if torch.is_tensor(out):
        return out
    pooled: torch.Tensor = out.pooler_output
    return pooled
