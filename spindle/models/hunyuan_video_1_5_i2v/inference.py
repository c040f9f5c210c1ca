"""HunyuanVideo-1.5 image-to-video inference: the text-to-video stage plus the conditioning image.

Mirrors diffusers' `HunyuanVideo15ImageToVideoPipeline.__call__`: the video's size is the image's aspect bucket at
the transformer's `target_size` (the pipeline's `calculate_default_height_width`; it takes no height or width: a
request giving both, which the stock pipeline cannot, gets that size, as training crops to its resolution), the image is center-cropped to it (`video_processor.resize(..., "crop")`), its
SigLIP embeddings come from the pipeline's `encode_image` and its first-frame condition latents and mask from its
`prepare_cond_latents_and_mask`. The rest is text-to-video's. Step-distilled (`use_meanflow`) transformers take a
second timestep the engine does not pass yet: they are refused at load.
"""

from __future__ import annotations

from typing import Any

import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.hunyuan_video_1_5.inference import HunyuanVideo15BeforeDenoisingStage, HunyuanVideo15Inference
from spindle.models.hunyuan_video_1_5_i2v import OPTIONS


class HunyuanVideo15I2VBeforeDenoisingStage(HunyuanVideo15BeforeDenoisingStage):
    pipeline_class = "diffusers:HunyuanVideo15ImageToVideoPipeline"

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        if self.transformer.config.use_meanflow:
            raise ValueError(
                "this HunyuanVideo-1.5 I2V transformer is step-distilled (use_meanflow in transformer/config.json): "
                "it takes a second timestep per step, which Spindle's engine does not pass yet; use a non-distilled "
                "checkpoint"
            )

    def check_size(self, params: SamplingParams) -> None:
        if not params.image:
            raise RequestError(
                "image is required: this is an image-to-video model; give the first frame", field="image"
            )
        given = [name for name in ("height", "width") if getattr(params, name) is not None]
        if len(given) == 1:
            other = "width" if given == ["height"] else "height"
            raise RequestError(
                f"{given[0]} needs {other} too: give both (the image is center-cropped to them) or neither (the "
                "image's aspect bucket at the model's target size, as HunyuanVideo15ImageToVideoPipeline sizes it)",
                field=given[0],
            )
        if given:
            super().check_size(params)

    def size(self, p: SamplingParams) -> tuple[int, int]:
        """The request's height and width where it gives them (a Spindle extension: the stock pipeline takes
        none), else the image's aspect bucket at the transformer's target_size (the pipeline's)."""
        if p.height is not None and p.width is not None:
            return p.height, p.width
        image = resolved(p.image, "image")[0]
        target = self.transformer.config.target_size
        height, width = self.text_pipe.video_processor.calculate_default_height_width(
            height=image.size[1], width=image.size[0], target_size=target
        )
        return int(height), int(width)

    def condition(self, req: Req) -> tuple[torch.Tensor, torch.Tensor]:
        assert req.latents is not None
        p, pipe, dtype = req.params, self.text_pipe, self.transformer.dtype
        height, width = self.size(p)
        image = pipe.video_processor.resize(
            resolved(p.image, "image")[0], height=height, width=width, resize_mode="crop"
        )
        embeds = pipe.encode_image(image=image, batch_size=p.batch_size, device=req.device, dtype=dtype)
        cond, mask = pipe.prepare_cond_latents_and_mask(
            latents=req.latents, image=image, batch_size=p.batch_size, height=height, width=width, dtype=dtype,
            device=req.device,
        )  # fmt: skip
        return torch.cat([cond, mask], dim=1), embeds


class HunyuanVideo15I2VInference(HunyuanVideo15Inference):
    options = OPTIONS
    family = "hunyuan_video_1_5_i2v"
    components: tuple[str, ...] = (*HunyuanVideo15Inference.components, "image_encoder", "feature_extractor")
    before_denoising_cls: Any = HunyuanVideo15I2VBeforeDenoisingStage

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # HunyuanVideo15ImageToVideoPipeline.__call__'s: text-to-video's, with the size left to the image
        params = super().default_params(components)
        params.height = params.width = None
        return params


INFERENCE = HunyuanVideo15I2VInference()
