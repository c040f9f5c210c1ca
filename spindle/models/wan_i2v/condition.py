"""Wan2.1 I2V's frozen condition components: Wan's (UMT5 text encoder, Wan VAE, flow-matching scheduler)
plus the conditioning image, encoded exactly as `WanImageToVideoPipeline` encodes it at inference.

The conditioning image of a sample is the clip's first frame, or the file its manifest entry names
(`"image": path`; the loader puts it in `batch["image"]`); an FLF2V checkpoint also takes the last frame's
(`"last_image": path`, `batch["last_image"]`). Each image goes through the pipeline's own
code as the uint8 RGB image a user would pass: `encode_image` (CLIP penultimate hidden states) and
`prepare_latents` (the VAE-encoded conditioning video, first frame then zeros, with the frame mask).
Training targets are T2V's; the transformer input concatenates [noisy latents, mask, conditioning latents].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from spindle.data.media import tensor_to_image
from spindle.model_index import component_class, read_model_index
from spindle.models.wan.condition import WanConditionModel
from spindle.models.wan_i2v import TEXT_LENGTH


class WanI2VConditionModel(WanConditionModel):
    pipeline_class = "diffusers:WanImageToVideoPipeline"
    # 2: the first-last-frame (FLF2V) conditions and the last frame in the cache key
    encoding_version = 2
    # the text length the transformer fixes (None: any), see below
    fixed_text_length: int | None = TEXT_LENGTH

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = TEXT_LENGTH):
        super().__init__(pipe, device, dtype, max_text_length)
        # image_encoder is None only in a folder without one (Wan2.2 I2V) or when loaded without encoders
        self.takes_image_embeds = pipe.image_encoder is not None or pipe.image_processor is not None
        if self.fixed_text_length is not None and max_text_length != self.fixed_text_length:
            raise ValueError(
                f"model.max_text_length must be {TEXT_LENGTH} for Wan I2V (got {max_text_length}): its transformer "
                f"reads the last {TEXT_LENGTH} context tokens as text and the rest as the image; set "
                f"model.max_text_length: {TEXT_LENGTH}"
            )

    @classmethod
    def request_images(cls, root: str | Path) -> tuple[int, int] | None:
        """With image embeddings (Wan2.1 I2V): one image, or exactly two for a first-last-frame (FLF2V)
        transformer (`pos_embed_seq_len`, as `read_checkpoint`); without (Wan2.2): the family's bounds."""
        index = read_model_index(root)
        if not any(component_class(index, name) for name in ("image_encoder", "image_processor")):
            return None
        config = json.loads((Path(root) / "transformer" / "config.json").read_text())
        return (2, 2) if config.get("pos_embed_seq_len") is not None else (1, 1)

    @torch.no_grad()
    def encode_images(
        self, images: torch.Tensor, num_frames: int, last_images: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Conditioning images [B, 3, H, W] in [-1, 1] (and the last frames', FLF2V) -> {"condition": [B, 4 + z,
        f, h, w]} (+ "image_embeds" [B, n, N, D]: the CLIP states of the sample's n = 1 or 2 images)."""
        pipe = self.pipe
        height, width = images.shape[-2:]
        conditions, embeds = [], []

        def preprocess(image: Any) -> torch.Tensor:
            out: torch.Tensor = pipe.video_processor.preprocess(image, height=height, width=width)
            return out.to(self.device, torch.float32)

        for i, frame in enumerate(images):
            image = tensor_to_image(frame)
            last = None if last_images is None else tensor_to_image(last_images[i])
            if self.takes_image_embeds:
                embeds.append(pipe.encode_image(image if last is None else [image, last], self.device).to(self.dtype))
            # One image per call: prepare_latents repeats its image's latents over `batch_size`. The noise
            # it would draw is unused here (training draws its own per sample), so pass a placeholder.
            placeholder = torch.empty(0, device=self.device)
            _, condition = pipe.prepare_latents(
                preprocess(image), 1, self.latents_mean.shape[1], height, width, num_frames, torch.float32,
                self.device, None, placeholder, None if last is None else preprocess(last),
            )  # fmt: skip
            conditions.append(condition.to(self.dtype))
        out = {"condition": torch.cat(conditions)}
        if embeds:
            out["image_embeds"] = torch.stack(embeds)
        return out

    def read_checkpoint(self, root: Path) -> None:
        super().read_checkpoint(root)
        # a transformer embedding one image per video cannot take a last frame's embeddings (FLF2V ones fold
        # two per sample: `pos_embed_seq_len`); one without image embeddings (Wan2.2) takes the last frame's latents
        config = json.loads((root / "transformer" / "config.json").read_text())
        folds_two = config.get("pos_embed_seq_len") is not None
        self.takes_last_image = not self.takes_image_embeds or folds_two
        self.needs_last_image = self.takes_image_embeds and folds_two

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        if batch.get("last_image") is not None and not self.takes_last_image:
            raise ValueError(
                "the data names a 'last_image', but this checkpoint is not first-last-frame (FLF2V): its transformer "
                "embeds one image per video (no pos_embed_seq_len); remove last_image from the manifest"
            )
        if batch.get("last_image") is None and self.needs_last_image:
            raise ValueError(
                "this first-last-frame (FLF2V) checkpoint needs a 'last_image' per sample (its transformer embeds "
                "the first and the last frame of every video); name one in each manifest entry"
            )
        pixels = batch["pixels"]
        images = batch.get("image")
        if images is None:  # the default conditioning image: each clip's first frame
            images = pixels[:, :, 0]
        encoded = super().encode(batch)  # checks the pixel shape first
        return {**encoded, **self.encode_images(images, pixels.shape[2], batch.get("last_image"))}

    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        inputs = super().training_inputs(conditions, generators)
        noisy = inputs["hidden_states"]
        inputs["hidden_states"] = torch.cat([noisy, conditions["condition"].to(noisy)], dim=1)
        if "image_embeds" in conditions:
            # [B, n, N, D] -> the pipeline's [B x n, N, D] (an FLF2V transformer folds each sample's two back)
            embeds = conditions["image_embeds"]
            inputs["encoder_hidden_states_image"] = embeds.flatten(0, 1).to(noisy.device)
        return inputs


CONDITION_MODEL = WanI2VConditionModel  # the family's condition model (DiTFamily finds it by this name)
