"""Wan text-to-video inference: its BeforeDenoisingStage, the shared stages' callbacks, defaults.

Mirrors diffusers' `WanPipeline.__call__` up to the denoising loop (prompt encoding is the
pipeline's own `encode_prompt`, latents come from `randn_tensor` with the request's generator,
timesteps from the checkpoint's scheduler), so outputs equal the reference pipeline's for a seed.
Unlike diffusers, sizes and frame counts the model cannot take are errors, not silently rounded.
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch

from spindle.contracts.request import (
    Req,
    RequestError,
    SamplingParams,
    check_frame_count,
    check_int_range,
    check_size,
    resolved,
)
from spindle.contracts.stage import BeforeDenoisingStage, InferenceSpec
from spindle.model_index import component_class
from spindle.models.shared.latents import mean_std_scale_shift
from spindle.models.wan import OPTIONS
from spindle.models.wan.parts import BOUNDARY, SECOND_TRANSFORMER, ExpertsPart


class WanBeforeDenoisingStage(BeforeDenoisingStage):
    def __init__(self, components: dict[str, Any], spec: WanInference):
        super().__init__(components, spec)
        self.experts = spec.experts  # a variant's part: what its step switch reads, set on each request
        # The family's pipeline without transformer: its `encode_prompt` (and, for I2V, its image
        # encoding and `prepare_latents`) is the reference code (prompt cleaning, padding, ...).
        self.text_pipe = self.make_reference_pipe(components)
        self.transformer = components["transformer"]
        self.scheduler = components["scheduler"]
        vae_cfg = components["vae"].config
        self.scale_temporal = vae_cfg.scale_factor_temporal
        if spec.options.frame_multiple not in (None, self.scale_temporal):
            raise ValueError(
                f"this Wan checkpoint's VAE compresses time {self.scale_temporal}x, but the family declares "
                f"num_frames = {spec.options.frame_multiple}k+1; Spindle serves Wan2.1-style VAEs"
            )
        self.scale_spatial = vae_cfg.scale_factor_spatial
        patch = self.transformer.config.patch_size
        self.h_multiple = self.scale_spatial * patch[1]
        self.w_multiple = self.scale_spatial * patch[2]

    def make_reference_pipe(self, components: dict[str, Any]) -> Any:
        from diffusers import WanPipeline

        return self.reference_pipe(WanPipeline, components)

    @staticmethod
    def reference_pipe(pipeline_cls: Any, components: dict[str, Any], **parts: Any) -> Any:
        """`pipeline_cls` (WanPipeline, WanImageToVideoPipeline) on the folder's tokenizer, text encoder, VAE and
        scheduler (+ `parts`), with no transformer: the stages run its prompt encoding and latents."""
        return pipeline_cls(
            tokenizer=components["tokenizer"],
            text_encoder=components["text_encoder"],
            vae=components["vae"],
            scheduler=components["scheduler"],
            transformer=None,
            **parts,
        )

    def image_latents(self, req: Req, *frames: Any) -> tuple[torch.Tensor, ...]:
        """WanImageToVideoPipeline's `prepare_latents` of the request: the noise (req.latents) and the VAE-encoded
        condition of `frames` (the first frame; FLF2V: and the last one), each resized to the request's size as
        the pipeline's `video_processor.preprocess` does."""
        p = req.params
        height, width = resolved(p.height, "height"), resolved(p.width, "width")
        pixels = [
            self.text_pipe.video_processor.preprocess(frame, height=height, width=width).to(req.device, torch.float32)
            for frame in frames
        ]
        out: tuple[torch.Tensor, ...] = self.text_pipe.prepare_latents(
            pixels[0],
            p.batch_size,
            self.latent_channels,
            height,
            width,
            resolved(p.num_frames, "num_frames"),
            torch.float32,
            req.device,
            req.generator,
            req.latents,
            *pixels[1:],
        )
        return out

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_size(params, self.h_multiple, self.w_multiple, f"VAE x{self.scale_spatial} x patch")
        check_frame_count(params, self.scale_temporal)
        check_int_range("max_sequence_length", params.max_sequence_length, minimum=1)
        self.check_positions(params)

    def check_positions(self, params: SamplingParams) -> None:
        """The transformer's rotary table covers `rope_max_seq_len` positions per axis (frames,
        height, width in patches); diffusers slices it without a check, so a longer axis fails
        mid-run. Refuse it here, naming the field and the largest value that fits."""
        limit = self.transformer.config.rope_max_seq_len
        p_t, p_h, p_w = self.transformer.config.patch_size
        k = self.scale_temporal
        frames = resolved(params.num_frames, "num_frames")
        height, width = resolved(params.height, "height"), resolved(params.width, "width")
        axes = (
            ("num_frames", ((frames - 1) // k + 1) // p_t, (limit * p_t - 1) * k + 1),
            ("height", height // self.scale_spatial // p_h, limit * self.h_multiple),
            ("width", width // self.scale_spatial // p_w, limit * self.w_multiple),
        )
        for name, positions, largest in axes:
            if positions > limit:
                raise RequestError(
                    f"{name} is past this model's positional range ({positions} positions on that axis; the "
                    f"transformer's rope_max_seq_len is {limit}): at most {largest}",
                    field=name,
                )

    @property
    def latent_channels(self) -> int:
        """Channels of the denoised latents (the transformer's input may carry conditioning channels too)."""
        return int(self.transformer.config.in_channels)

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        return (
            p.batch_size,
            self.latent_channels,
            (resolved(p.num_frames, "num_frames") - 1) // self.scale_temporal + 1,
            resolved(p.height, "height") // self.scale_spatial,
            resolved(p.width, "width") // self.scale_spatial,
        )

    def forward(self, req: Req) -> Req:
        p = req.params
        device = req.device
        prompts = p.prompts
        negative = p.negative_prompt
        if p.do_cfg:
            negative = [negative or ""] * len(prompts) if not isinstance(negative, list) else negative
        prompt_embeds, negative_embeds = self.text_pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=negative if p.do_cfg else None,
            do_classifier_free_guidance=p.do_cfg,
            num_videos_per_prompt=p.num_outputs_per_prompt,
            max_sequence_length=p.max_sequence_length,
            device=device,
        )
        dtype = self.transformer.dtype
        req.model_dtype = dtype
        req.prompt_embeds = prompt_embeds.to(dtype)
        req.negative_prompt_embeds = negative_embeds.to(dtype) if negative_embeds is not None else None
        req.do_cfg = p.do_cfg
        req.cfg_scale = float(resolved(p.guidance_scale, "guidance_scale"))  # Wan's guidance_scale is the CFG scale

        scheduler = copy.deepcopy(self.scheduler)  # schedulers are stateful: one copy per request
        scheduler.set_timesteps(resolved(p.num_inference_steps, "num_inference_steps"), device=device)
        scheduler.set_begin_index(0)
        req.scheduler = scheduler
        req.timesteps = scheduler.timesteps

        from diffusers.utils.torch_utils import randn_tensor

        shape = self.latent_shape(p)
        req.latents = randn_tensor(shape, generator=req.generator, device=device, dtype=torch.float32)
        req.raw_latent_shape = tuple(shape)
        if self.experts is not None:  # from the CFG scale and the scheduler set above
            self.experts.prepare_request(req, self.components)
        return req


class WanInference(InferenceSpec):
    options = OPTIONS
    family = "wan"
    media = "video"
    components: tuple[str, ...] = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    before_denoising_cls = WanBeforeDenoisingStage
    # a variant's further transformers, switched per step (Wan2.2 A14B's two experts: the part its folder supplies,
    # `spindle.models.wan.parts`); None: one transformer denoises every step
    experts: ExpertsPart | None = None
    # the family serving this pipeline's two-expert (Wan2.2 A14B) folders, named when one is forced on this spec
    two_expert_family = "wan22"

    def __init__(self) -> None:
        if self.experts is not None:  # the experts' transformers and the model_index.json values they read load too
            self.expert_components = self.experts.components
            self.pipeline_config = self.experts.pipeline_config

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # diffusers WanPipeline.__call__ defaults (negative prompt None -> "").
        return SamplingParams(
            negative_prompt="",
            height=480,
            width=832,
            num_frames=81,
            num_inference_steps=50,
            guidance_scale=5.0,
            max_sequence_length=512,
        )

    def check_checkpoint(self, model_index: dict[str, Any]) -> None:
        self.check_experts(model_index)
        if model_index.get("expand_timesteps"):
            raise ValueError(
                f"this is a Wan2.2 TI2V-5B folder (expand_timesteps), which {self.family} does not serve; it is the "
                "wan22_ti2v family's: remove model.family (or set it to wan22_ti2v)"
            )

    def check_experts(self, model_index: dict[str, Any]) -> None:
        """The folder has the transformers this spec denoises with: what the experts part needs, or (without one)
        no second transformer, which a single-transformer spec would silently leave out."""
        if self.experts is not None:
            self.experts.check_checkpoint(model_index, self.family)
        elif model_index.get(BOUNDARY) is not None or component_class(model_index, SECOND_TRANSFORMER):
            family = self.two_expert_family
            raise ValueError(
                f"this is a two-expert Wan2.2 A14B folder ({SECOND_TRANSFORMER} / {BOUNDARY}), which {self.family} does "
                f"not serve; it is the {family} family's: remove model.family (or set it to {family})"
            )

    def step_denoiser(self, req: Req, t: torch.Tensor) -> tuple[str, float]:
        if self.experts is None:
            return super().step_denoiser(req, t)
        return self.experts.step_denoiser(req, t)

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        return {
            "hidden_states": latents.to(req.model_dtype),
            "timestep": t.expand(latents.shape[0]),
            "encoder_hidden_states": req.prompt_embeds if branch == "cond" else req.negative_prompt_embeds,
            "attention_kwargs": None,
            "return_dict": False,
        }

    def request_constant_modules(self, transformer: torch.nn.Module, compiled: bool) -> list[torch.nn.Module]:
        # The prompt embeddings enter through the text projection and each block's cross-attention
        # key/value (+ its RMSNorm): the same every step. Fused projections (to_kv) stay as they are.
        wan: Any = transformer  # diffusers WanTransformer3DModel
        modules: list[torch.nn.Module] = [wan.condition_embedder.text_embedder]
        if not compiled:
            for block in wan.blocks:
                attn = block.attn2
                if not attn.fused_projections:
                    modules += [attn.to_k, attn.to_v, attn.norm_k]
        return modules

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        pt, ph, pw = cast(Any, transformer).config.patch_size  # a diffusers model: its config
        _, _, f, h, w = resolved(req.raw_latent_shape, "raw_latent_shape")
        return (f // pt) * (h // ph) * (w // pw)

    def decode_scale_shift(self, vae: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return mean_std_scale_shift(vae, latents)


INFERENCE = WanInference()
