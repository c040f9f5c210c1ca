"""Gemma 3's images as its stock processor makes them (`Gemma3Processor` on `Gemma3ImageProcessor`), built from
the two pieces Spindle's processor side needs (spindle.data.multimodal.GridImages has the same members):

- each image resized to the SigLIP tower's fixed size, rescaled and normalised: pixel_values [1, 3, size, size]
  (no patch grid);
- the chat template's `<start_of_image>` (the tokenizer's `boi_token`) becomes Gemma3Processor's
  `full_image_sequence`: "\\n\\n" + boi + `mm_tokens_per_image` x `image_token` + eoi + "\\n\\n".

Pan-and-scan (preprocessor_config.json `do_pan_and_scan`: crops of a wide image, each its own block of soft
tokens) is refused, naming the key; the released checkpoints ship it off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.data.multimodal import Vision, VisionOptions


class FixedSizeImages:
    merge_size = 1  # no patch merging (and no video, whose grids it would divide)

    def __init__(self, model_path: str | Path, tokenizer: Any, config: Any, options: VisionOptions):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_path)
        if self.processor.do_pan_and_scan:
            raise ValueError(
                f"{Path(model_path) / 'preprocessor_config.json'}: do_pan_and_scan is on; Spindle trains Gemma 3 on "
                "whole images only: set it to false (the released checkpoints' setting)"
            )
        for key in ("min_pixels", "max_pixels"):
            if getattr(options, key):
                raise ValueError(
                    f"data.{key}: Gemma 3 resizes every image to its tower's fixed size "
                    f"({self.processor.size['height']}x{self.processor.size['width']}); leave it unset"
                )
        self.pad_token = str(tokenizer.boi_token)
        self.token_ids = {int(config.image_token_id)}
        self.count = int(config.mm_tokens_per_image)
        self.sequence = f"\n\n{tokenizer.boi_token}{tokenizer.image_token * self.count}{tokenizer.eoi_token}\n\n"

    def encode(self, rgb: Any) -> Vision:
        out = self.processor(images=[rgb], return_tensors="pt")
        return Vision("image", out["pixel_values"], None)

    def tokens(self, image: Vision) -> int:
        return self.count

    def text(self, image: Vision, tokens: int) -> str:
        return self.sequence


IMAGES = FixedSizeImages
