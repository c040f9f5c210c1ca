"""Qwen-Image text-to-image inference: its BeforeDenoisingStage, the shared stages' callbacks, defaults.

Mirrors diffusers' `QwenImagePipeline.__call__` up to the denoising loop: prompt encoding is the
pipeline's own `encode_prompt` (chat template, template prefix dropped, variable-length embeddings
with a mask that is None when every token is valid), latents its `prepare_latents` (drawn in the
VAE layout, 2x2-packed), timesteps its sigmas with the resolution-dependent shift `mu`.
`true_cfg_scale` with a `negative_prompt` is classifier-free guidance with Qwen-Image's norm
rescale (`combine_cfg`); `guidance_scale` is the embedded guidance of guidance-distilled variants
and ignored by the others, as in diffusers.

The conditional and unconditional prompts may have different token counts. Two forwards (or
CFG-parallel) pass each as diffusers does; a batched CFG forward pads the shorter one with masked
zeros (`batch_cfg_kwargs`), which the joint attention never looks at.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.models.qwenimage import OPTIONS
from spindle.models.qwenimage.condition import MAX_SEQUENCE_LENGTH, pad_text
from spindle.models.shared.inference import (
    PackedImageInference,
    PipelineBeforeDenoisingStage,
    check_packed_image_request,
)
from spindle.models.shared.latents import mean_std_scale_shift


class QwenImageBeforeDenoisingStage(PipelineBeforeDenoisingStage):
    pipeline_class = "diffusers:QwenImagePipeline"

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_packed_image_request(params, self.vae_scale_factor, MAX_SEQUENCE_LENGTH, "Qwen-Image")
        if (
            self.scheduler.config.get("shift_terminal")
            and resolved(params.num_inference_steps, "num_inference_steps") < 2
        ):
            # stretching the schedule to its terminal sigma divides by zero with one step (NaN image)
            raise RequestError(
                f"num_inference_steps must be >= 2 for this checkpoint's scheduler (shift_terminal="
                f"{self.scheduler.config.shift_terminal}); got {params.num_inference_steps}",
                field="num_inference_steps",
            )
        self.check_positions(params)

    def check_positions(self, params: SamplingParams) -> None:
        """Qwen-Image's rotary table (`QwenEmbedRope`) has a fixed number of positions (4096 in
        diffusers). The image's patch rows and columns are centred on 0 (`scale_rope`), and the text
        tokens take the positions after half the longer axis: `max(rows, cols) // 2 + text tokens`
        must fit, or diffusers slices a short text table and the run fails mid-way (after the text
        encoder ran). The text may be up to `max_sequence_length` tokens, so that is what is counted."""
        table = getattr(getattr(self.transformer, "pos_embed", None), "pos_freqs", None)
        if table is None:  # no fixed table in this transformer: nothing to overrun
            return
        positions = int(table.shape[0])
        multiple = 2 * self.vae_scale_factor  # pixels per 2x2-packed patch
        text = resolved(params.max_sequence_length, "max_sequence_length")
        rows = resolved(params.height, "height") // multiple
        cols = resolved(params.width, "width") // multiple
        scale = 2 if self.transformer.pos_embed.scale_rope else 1
        name, patches = ("height", rows) if rows >= cols else ("width", cols)
        if patches // scale + text > positions:
            largest = ((positions - text) * scale + scale - 1) * multiple
            raise RequestError(
                f"{name} is past this model's positional range: {patches} patches on that axis put the text's "
                f"{text} positions (max_sequence_length) at {patches // scale}..{patches // scale + text - 1}, past "
                f"the {positions} of the transformer's rotary table; at most {largest} with max_sequence_length "
                f"{text} (or lower max_sequence_length)",
                field=name,
            )

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device, dtype: torch.dtype):
        embeds, mask = self.text_pipe.encode_prompt(
            prompt=prompts,
            device=device,
            num_images_per_prompt=p.num_outputs_per_prompt,
            max_sequence_length=p.max_sequence_length,
        )
        return embeds.to(dtype), mask

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        """The VAE layout of the latents `forward` prepares: [B, C, 1, h, w] (a 3-D VAE, one frame)."""
        h = resolved(p.height, "height") // self.vae_scale_factor
        w = resolved(p.width, "width") // self.vae_scale_factor
        return (p.batch_size, self.transformer.config.in_channels // 4, 1, h, w)

    def prepare_latents(self, req: Req) -> torch.Tensor:
        """The initial noise, float32 from the request's generator, 2x2-packed (the pipeline's `prepare_latents`)."""
        latents: torch.Tensor = self.text_pipe.prepare_latents(*self.latent_args(req))
        return latents

    def img_shapes(self, p: SamplingParams) -> list[tuple[int, int, int]]:
        """The transformer's `img_shapes` entry of one prompt: (frames, rows, columns) of packed tokens."""
        h, w = self.latent_shape(p)[-2:]
        return [(1, h // 2, w // 2)]

    def forward(self, req: Req) -> Req:
        p = req.params
        device = req.device
        true_cfg = float(p.extra["true_cfg_scale"])
        req.do_cfg = true_cfg > 1 and p.negative_prompt is not None  # QwenImagePipeline's rule
        req.cfg_scale = true_cfg  # the CFG scale the shared DenoisingStage combines with
        dtype = self.transformer.dtype
        req.model_dtype = dtype

        req.prompt_embeds, req.extra["prompt_mask"] = self.encode(p.prompts, p, device, dtype)
        if req.do_cfg:
            negative = p.negative_prompt
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            req.negative_prompt_embeds, req.extra["negative_mask"] = self.encode(
                resolved(negative, "negative_prompt"), p, device, dtype
            )

        req.latents = self.prepare_latents(req)
        req.raw_latent_shape = self.latent_shape(p)
        # as QwenImagePipeline: one entry per prompt (RoPE reads the first; all images share a size)
        req.extra["img_shapes"] = [self.img_shapes(p)] * len(p.prompts)

        self.set_embedded_guidance(req, device)
        self.set_timesteps(req, device)
        return req


class QwenImageInference(PackedImageInference):
    options = OPTIONS
    family = "qwenimage"
    pipeline_class = QwenImageBeforeDenoisingStage.pipeline_class
    components: tuple[str, ...] = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    before_denoising_cls = QwenImageBeforeDenoisingStage

    def pipeline_defaults(self, components: dict[str, Any]) -> SamplingParams:
        # QwenImagePipeline.__call__ defaults: 128 latent pixels x VAE factor, 50 steps, true_cfg_scale
        # 4 (CFG runs once a negative_prompt is given), max_sequence_length 512. guidance_scale only
        # matters to guidance-distilled variants; 1.0 stands for "unset" there.
        size = 128 * 2 ** len(components["vae"].config.temperal_downsample)
        return SamplingParams(
            negative_prompt=None,
            height=size,
            width=size,
            num_inference_steps=50,
            guidance_scale=1.0,
            max_sequence_length=512,
        )

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        cond = branch == "cond"
        x = req.extra
        return {
            **self.packed_kwargs(req, latents, t, branch),
            "encoder_hidden_states_mask": x["prompt_mask"] if cond else x["negative_mask"],
            "img_shapes": x["img_shapes"],
            "attention_kwargs": {},
        }

    def batch_cfg_kwargs(self, cond: dict[str, Any], uncond: dict[str, Any], batch_size: int) -> dict[str, Any]:
        """Pad both prompts' embeddings to one token count (masked zeros), then the default merge."""
        length = max(cond["encoder_hidden_states"].shape[1], uncond["encoder_hidden_states"].shape[1])
        padded = []
        for kw in (cond, uncond):
            embeds, mask = pad_text(kw["encoder_hidden_states"], kw["encoder_hidden_states_mask"], length)
            padded.append({**kw, "encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask})
        return super().batch_cfg_kwargs(padded[0], padded[1], batch_size)

    def prepare_sequence_parallel(self, req: Req, degree: int) -> None:
        """The `_cp_plan` splits the text tokens too: pad each prompt's to a multiple of `degree`
        with masked zeros (invisible to the joint attention, as in `batch_cfg_kwargs`)."""
        pairs = [("prompt_embeds", "prompt_mask")]
        if req.do_cfg:
            pairs.append(("negative_prompt_embeds", "negative_mask"))
        for embeds_name, mask_name in pairs:
            embeds = getattr(req, embeds_name)
            length = -(-embeds.shape[1] // degree) * degree
            padded, req.extra[mask_name] = pad_text(embeds, req.extra[mask_name], length)
            setattr(req, embeds_name, padded)

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        """QwenImagePipeline's true CFG: the guided prediction rescaled to the conditional one's norm."""
        combined = uncond + cfg_scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mean_std_scale_shift(vae, latents)

    def postprocess(self, decoded: torch.Tensor, req: Req) -> np.ndarray:
        return super().postprocess(decoded[:, :, 0], req)  # the 3-D VAE decodes one frame per image


INFERENCE = QwenImageInference()
