"""Z-Image text-to-image inference: its BeforeDenoisingStage, the shared stages' callbacks, defaults.

Mirrors diffusers' `ZImagePipeline.__call__`: prompts go through the pipeline's own `encode_prompt`
(Qwen3 chat template, the second-to-last hidden state, padding dropped: one variable-length tensor
per prompt), latents through its `prepare_latents` (the VAE layout [B, C, h, w]; the transformer
patchifies 2x2 itself), sigmas `get_default_z_image_sigmas` with the scheduler's shift. The
transformer takes lists (one latent [C, 1, h, w] and one caption per sample) and predicts
`x0 - noise`, which the pipeline negates into the scheduler's velocity; its timestep is
`(1000 - t) / 1000`. CFG runs when `guidance_scale > 0` (Z-Image-Turbo is sampled with 0) as
`cond + scale * (cond - uncond)`, the unconditional prompt "" unless a negative prompt is given.

The engine's `Req` holds prompt embeddings as one batch tensor: the captions are zero-padded to the
longest with their lengths kept (`req.extra`), and cut back to their lengths for every forward, so
the transformer sees exactly the pipeline's list. The pipeline's `cfg_normalization` and
`cfg_truncation` are left at their defaults (off), which are what this engine runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from spindle.contracts.request import Req, RequestError, SamplingParams, resolved
from spindle.contracts.stage import InferenceSpec
from spindle.models.shared.inference import PipelineBeforeDenoisingStage, check_packed_image_request
from spindle.models.z_image import MAX_SEQUENCE_LENGTH, OPTIONS
from spindle.models.z_image.condition import captions, pad_captions


class ZImageBeforeDenoisingStage(PipelineBeforeDenoisingStage):
    pipeline_class = "diffusers:ZImagePipeline"

    def validate(self, params: SamplingParams) -> None:
        super().validate(params)
        check_packed_image_request(params, self.vae_scale_factor, MAX_SEQUENCE_LENGTH, "Z-Image")
        # the rotary tables have `axes_lens` positions per axis; a patch row or column past them fails mid-run
        multiple = 2 * self.vae_scale_factor
        for name, positions in zip(("height", "width"), self.transformer.config.axes_lens[1:], strict=True):
            if resolved(getattr(params, name), name) // multiple > positions:
                raise RequestError(
                    f"{name} is past this model's positional range: at most {positions * multiple} "
                    f"({positions} 2x2 patches, the transformer's axes_lens); got {getattr(params, name)}",
                    field=name,
                )

    def default_sigmas(self, steps: int) -> Any:
        module = importlib.import_module(type(self.text_pipe).__module__)
        return module.get_default_z_image_sigmas(steps)

    def image_seq_len(self, latents: torch.Tensor) -> int:
        return (latents.shape[2] // 2) * (latents.shape[3] // 2)  # 2x2 patches of [B, C, h, w]

    def latent_shape(self, p: SamplingParams) -> tuple[int, ...]:
        """The latents `forward` prepares: [B, C, h, w] in the VAE layout (the pipeline's `prepare_latents`)."""
        h = resolved(p.height, "height") // self.vae_scale_factor
        w = resolved(p.width, "width") // self.vae_scale_factor
        return (p.batch_size, self.transformer.in_channels, h, w)

    def encode(self, prompts: list[str], p: SamplingParams, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (embeddings zero-padded to the longest [B, S, D], lengths [B]), each repeated per image."""
        embeds, _ = self.text_pipe.encode_prompt(
            prompt=list(prompts),  # the pipeline writes the templated prompts into the list it is given
            device=device,
            do_classifier_free_guidance=False,
            max_sequence_length=p.max_sequence_length,
        )
        embeds = [e for e in embeds for _ in range(p.num_outputs_per_prompt)]
        return pad_captions(embeds)

    def forward(self, req: Req) -> Req:
        p = req.params
        device = req.device
        scale = float(resolved(p.guidance_scale, "guidance_scale"))
        req.do_cfg = scale > 0  # ZImagePipeline's rule
        req.cfg_scale = scale
        req.model_dtype = self.transformer.dtype
        req.prompt_embeds, req.extra["prompt_lengths"] = self.encode(p.prompts, p, device)
        if req.do_cfg:
            negative = p.negative_prompt if p.negative_prompt is not None else ""
            negative = [negative] * len(p.prompts) if isinstance(negative, str) else negative
            req.negative_prompt_embeds, req.extra["negative_lengths"] = self.encode(negative, p, device)
        req.latents = self.text_pipe.prepare_latents(
            p.batch_size,
            self.transformer.in_channels,
            resolved(p.height, "height"),
            resolved(p.width, "width"),
            torch.float32,
            device,
            req.generator,
        )
        req.raw_latent_shape = self.latent_shape(p)
        self.set_timesteps(req, device)
        return req


class ZImageSpec(InferenceSpec):
    options = OPTIONS
    family = "z_image"
    media = "image"
    output_layout = None  # the transformer returns a list of per-sample tensors: no spatial-output caches
    components: tuple[str, ...] = ("tokenizer", "text_encoder", "vae", "scheduler", "transformer")
    before_denoising_cls = ZImageBeforeDenoisingStage

    def default_params(self, components: dict[str, Any]) -> SamplingParams:
        # ZImagePipeline.__call__ defaults: 1024x1024 whatever the VAE, 50 steps, guidance 5 (CFG on, with
        # the empty negative prompt), max_sequence_length 512
        return SamplingParams(
            negative_prompt=None,
            height=1024,
            width=1024,
            num_inference_steps=50,
            guidance_scale=5.0,
            max_sequence_length=512,
        )

    def denoiser_kwargs(self, req: Req, latents: torch.Tensor, t: torch.Tensor, branch: str) -> dict[str, Any]:
        cond = branch == "cond"
        embeds = req.prompt_embeds if cond else req.negative_prompt_embeds
        assert embeds is not None, "the before-denoising stage sets the branch's prompt embeddings"
        lengths = req.extra["prompt_lengths" if cond else "negative_lengths"]
        timestep = t.expand(latents.shape[0])
        return {
            "x": list(latents.to(req.model_dtype).unsqueeze(2).unbind(0)),
            "t": (1000 - timestep) / 1000,
            "cap_feats": captions(embeds, lengths),
            "return_dict": False,
        }

    def batch_cfg_kwargs(self, cond: dict[str, Any], uncond: dict[str, Any], batch_size: int) -> dict[str, Any]:
        """One forward of both branches, as the pipeline batches them: the lists joined [cond; uncond]."""
        return {
            "x": cond["x"] + uncond["x"],
            "t": torch.cat([cond["t"], uncond["t"]]),
            "cap_feats": cond["cap_feats"] + uncond["cap_feats"],
            "return_dict": False,
        }

    def sequence_length(self, req: Req, transformer: torch.nn.Module) -> int:
        h, w = resolved(req.raw_latent_shape, "raw_latent_shape")[-2:]
        return (h // 2) * (w // 2)

    def model_output(self, out: Any) -> torch.Tensor:
        """The per-sample outputs [C, 1, h, w] stacked and negated: the velocity the scheduler steps with."""
        return -torch.stack([o.float() for o in out[0]], dim=0).squeeze(2)

    def combine_cfg(self, cond: torch.Tensor, uncond: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        return cond + cfg_scale * (cond - uncond)  # ZImagePipeline's form (the scale counts from 0)


INFERENCE = ZImageSpec()
