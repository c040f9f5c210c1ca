"""HunyuanVideo-1.5 text-to-video inference: its BeforeDenoisingStage, the shared stages' callbacks, defaults.

Mirrors diffusers' `HunyuanVideo15Pipeline.__call__`: prompts go through the pipeline's own prompt encoders (the
Qwen2.5-VL chat template, its third-to-last hidden state cropped after the template, masked; and the ByT5 glyph
encoding of the prompt's quoted text), latents through its `prepare_latents` (the VAE layout [B, C, F, h, w]),
the condition latents and mask through its `prepare_cond_latents_and_mask` (zeros for text-to-video), the
image embeddings zeros of the transformer's width, sigmas linear 1 -> 1/steps with the scheduler's shift. The
transformer takes [latents; condition; mask] on the channel axis and the raw timestep, and predicts the
velocity the scheduler steps with.

Classifier-free guidance is the checkpoint's guider (`ClassifierFreeGuidance`, a component of the folder): its
`guidance_scale` is the request's default, CFG runs unless the scale is 1, and the branches combine as
`uncond + scale * (cond - uncond)`; the unconditional prompt is "" unless a negative prompt is given. A guider
configured otherwise (the original formulation, rescale, a step window) is refused at load, as this engine would
not run it.
"""

from __future__ import annotations

import copy
import importlib
import math
from typing import Any

import numpy as np
import torch

from spindle.contracts.family import import_object
from spindle.contracts.request import (
    Req,
    SamplingParams,
    check_frame_count,
    check_int_range,
    check_size,
    resolved,
)
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec
from spindle.models.hunyuan_video_1_5 import MAX_SEQUENCE_LENGTH, OPTIONS


def register_block_outputs() -> None:
    """Tell diffusers' cache hooks (first-block cache, MagCache) where HunyuanVideo15TransformerBlock returns its
    two streams, as diffusers registers its other dual-stream blocks (its registry has no entry for this one)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15TransformerBlock

    outputs = TransformerBlockMetadata(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
    TransformerBlockRegistry.register(model_class=HunyuanVideo15TransformerBlock, metadata=outputs)


register_block_outputs()

# the guider settings this engine runs (ClassifierFreeGuidance's defaults but the scale)
GUIDER_DEFAULTS = {
    "guidance_rescale": 0.0,
    "use_original_formulation": False,
    "start": 0.0,
    "stop": 1.0,
    "enabled": True,
}


def check_guider(guider: Any) -> float:
    """The folder's guider is a plain CFG guider -> its guidance scale; else a ValueError naming the setting."""
    if type(guider).__name__ != "ClassifierFreeGuidance":
        raise ValueError(
            f"guider/ is a {type(guider).__name__}; Spindle runs HunyuanVideo-1.5 with ClassifierFreeGuidance"
        )
    for key, value in GUIDER_DEFAULTS.items():
        if guider.config.get(key, value) != value:
            raise ValueError(
                f"guider/config.json sets {key}={guider.config[key]!r}, which Spindle's engine does not run; set it to "
                f"{value!r} (the request's guidance_scale is the CFG scale)"
            )
    return float(guider.config["guidance_scale"])


def encode_prompts(pipe: Any, prompts: list[str], max_length: int, device: Any) -> tuple[torch.Tensor, ...]:
    """-> (Qwen2.5-VL embeddings, mask, ByT5 glyph embeddings, mask) of `prompts`: the pipeline's `encode_prompt`
    with the Qwen text padded to `max_length` tokens (its `tokenizer_max_length`, 1000 in the pipeline)."""
    embeds, mask = pipe._get_mllm_prompt_embeds(
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        prompt=prompts,
        device=device,
        tokenizer_max_length=max_length,
        system_message=pipe.system_message,
        crop_start=pipe.prompt_template_encode_start_idx,
    )
    glyph, glyph_mask = pipe._get_byt5_prompt_embeds(
        tokenizer=pipe.tokenizer_2,
        text_encoder=pipe.text_encoder_2,
        prompt=prompts,
        device=device,
        tokenizer_max_length=pipe.tokenizer_2_max_length,
    )
    return embeds, mask, glyph, glyph_mask


class HunyuanVideo15BeforeDenoisingStage(BeforeDenoisingStage):
    pipeline_class = "diffusers:HunyuanVideo15Pipeline"

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        # the family's pipeline without its transformer: its prompt encoders and latent helpers are the reference
        parts = {k: v for k, v in components.items() if k != spec.transformer_component}
        self.text_pipe = import_object(self.pipeline_class)(**parts, transformer=None)
        self.transformer = components[spec.transformer_component]
        self.scheduler = components["scheduler"]
        check_guider(components["guider"])
        self.scale_temporal = self.text_pipe.vae_scale_factor_temporal
        self.scale_spatial = self.text_pipe.vae_scale_factor_spatial
        self.multiple = self.scale_spatial * self.transformer.config.patch_size

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        self.check_size(params)
        check_frame_count(params, self.scale_temporal)
        check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=MAX_SEQUENCE_LENGTH)

    def check_size(self, params: SamplingParams) -> None:
        check_size(params, self.multiple, self.multiple, f"VAE x{self.scale_spatial} x patch")

    def size(self, p: SamplingParams) -> tuple[int, int]:
        """(height, width) of the video: the request's (image-to-video: the conditioning image's bucket)."""
        return resolved(p.height, "height"), resolved(p.width, "width")

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        height, width = self.size(p)
        return (
            p.batch_size,
            self.text_pipe.num_channels_latents,
            (resolved(p.num_frames, "num_frames") - 1) // self.scale_temporal + 1,
            height // self.scale_spatial,
            width // self.scale_spatial,
        )

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, ...]:
        """The four text tensors of `prompts`, each repeated per video, in the transformer's dtype."""
        length = resolved(p.max_sequence_length, "max_sequence_length")
        tensors = encode_prompts(self.text_pipe, prompts, length, device)
        n = p.num_outputs_per_prompt
        return tuple(t.repeat_interleave(n, dim=0).to(self.transformer.dtype) for t in tensors)

    def condition(self, req: Req) -> tuple[torch.Tensor, torch.Tensor]:
        """(the condition latents with their mask [B, C + 1, F, h, w], the image embeddings): text-to-video's zeros
        (image-to-video: the first frame's)."""
        assert req.latents is not None
        dtype = self.transformer.dtype
        cond, mask = self.text_pipe.prepare_cond_latents_and_mask(req.latents, dtype, req.device)
        batch = req.latents.shape[0]
        # (the pipeline reads the width off its transformer, which this reference pipeline has not)
        tokens, width = self.text_pipe.vision_num_semantic_tokens, self.transformer.config.image_embed_dim
        return torch.cat([cond, mask], dim=1), torch.zeros(batch, tokens, width, dtype=dtype, device=req.device)

    def forward(self, req: Req) -> Req:
        p = req.params
        device = req.device
        scale = float(resolved(p.guidance_scale, "guidance_scale"))
        req.do_cfg = not math.isclose(scale, 1.0)  # ClassifierFreeGuidance's rule
        req.cfg_scale = scale
        req.model_dtype = self.transformer.dtype
        embeds, mask, glyph, glyph_mask = self.encode(p.prompts, p, device)
        req.prompt_embeds = embeds
        req.extra.update(prompt_mask=mask, glyph=glyph, glyph_mask=glyph_mask)
        if req.do_cfg:
            negative = p.negative_prompt if p.negative_prompt is not None else ""
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            embeds, mask, glyph, glyph_mask = self.encode(negative, p, device)
            req.negative_prompt_embeds = embeds
            req.extra.update(negative_mask=mask, negative_glyph=glyph, negative_glyph_mask=glyph_mask)
        req.latents = self.text_pipe.prepare_latents(
            p.batch_size,
            self.text_pipe.num_channels_latents,
            *self.size(p),
            resolved(p.num_frames, "num_frames"),
            torch.float32,
            device,
            req.generator,
        )
        req.raw_latent_shape = self.latent_shape(p)
        req.extra["condition"], req.extra["image_embeds"] = self.condition(req)
        steps = resolved(p.num_inference_steps, "num_inference_steps")
        module = importlib.import_module(type(self.text_pipe).__module__)
        scheduler = copy.deepcopy(self.scheduler)  # schedulers are stateful: one copy per request
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        req.timesteps, _ = module.retrieve_timesteps(scheduler, steps, device, sigmas=sigmas)
        scheduler.set_begin_index(0)
        req.scheduler = scheduler
        return req


class HunyuanVideo15Inference(InferenceSpec):
    options = OPTIONS
    family = "hunyuan_video_1_5"
    media = "video"
    components: tuple[str, ...] = (
        "tokenizer",
        "text_encoder",
        "tokenizer_2",
        "text_encoder_2",
        "vae",
        "scheduler",
        "guider",
        "transformer",
    )
    before_denoising_cls: Any = HunyuanVideo15BeforeDenoisingStage
    follows_trained_text_length = False  # HunyuanVideo15Pipeline always pads to 1000 tokens (no argument for it)
    # diffusers' AutoencoderKLHunyuanVideo15 builds its attention's causal mask for one video (a batch fails in it)
    videos_per_decode = 1

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # HunyuanVideo15Pipeline.__call__ defaults: the 16:9 bucket of the transformer's target_size, 121 frames,
        # 50 steps, the guider's scale (CFG with "" as the negative prompt), 1000 Qwen tokens
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        spatial = components["vae"].spatial_compression_ratio
        sizes = HunyuanVideo15ImageProcessor(vae_scale_factor=spatial)
        height, width = sizes.calculate_default_height_width(9, 16, components["transformer"].config.target_size)
        return SamplingParams(
            negative_prompt=None,
            height=height,
            width=width,
            num_frames=121,
            num_inference_steps=50,
            guidance_scale=check_guider(components["guider"]),
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        cond = branch == "cond"
        embeds = req.prompt_embeds if cond else req.negative_prompt_embeds
        x = req.extra
        hidden = torch.cat([latents.to(req.model_dtype), x["condition"]], dim=1)
        return {
            "hidden_states": hidden,
            "image_embeds": x["image_embeds"],
            "timestep": t.expand(latents.shape[0]).to(hidden.dtype),
            "encoder_hidden_states": embeds,
            "encoder_attention_mask": x["prompt_mask" if cond else "negative_mask"],
            "encoder_hidden_states_2": x["glyph" if cond else "negative_glyph"],
            "encoder_attention_mask_2": x["glyph_mask" if cond else "negative_glyph_mask"],
            "attention_kwargs": None,
            "return_dict": False,
        }

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        _, _, f, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        config: Any = transformer.config  # a diffusers model: its config
        return (f // config.patch_size_t) * (h // config.patch_size) * (w // config.patch_size)


INFERENCE = HunyuanVideo15Inference()
