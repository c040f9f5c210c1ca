"""Condition models built on a family's own diffusers pipeline (loaded without its transformer)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.config import TimestepConfig
from spindle.contracts.condition import ConditionModel, PixelGrid
from spindle.contracts.family import import_object
from spindle.model_index import component_class, model_index_path, read_model_index
from spindle.models.shared.latents import resolution_shift
from spindle.models.shared.reference_tokens import ReferenceTokens
from spindle.ops.flow_matching import flow_matching_pair, sample_sigmas

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on


def frames_as_images(pixels: torch.Tensor, family: str) -> torch.Tensor:
    """[B, C, 1, H, W] (the loader's layout; images have one frame) -> [B, C, H, W] for image families."""
    if pixels.ndim == 4:
        return pixels
    if pixels.ndim != 5 or pixels.shape[2] != 1:
        raise ValueError(
            f"{family} generates images: pixels must be [B, C, 1, H, W] (one frame), got {tuple(pixels.shape)}; "
            f"train on an image dataset or set data.num_frames: 1"
        )
    return pixels[:, :, 0]


def meta_vae(root: str | Path) -> Any:
    """The checkpoint's VAE built from its config on the meta device: its config (class defaults filled
    in) and attributes, no weight read."""
    import diffusers

    name = component_class(read_model_index(root), "vae")
    if name is None:
        raise FileNotFoundError(f"{model_index_path(root)} names no vae: a DiT pipeline folder has one")
    vae_cls = getattr(diffusers, name)
    with torch.device("meta"):
        return vae_cls.from_config(vae_cls.load_config(Path(root) / "vae"))


def encoder_placeholders(root: str | Path) -> dict[str, Any]:
    """from_pretrained overrides that keep a pipeline's encoders out of memory: every model component
    but the scheduler is None, except the VAE, built on the meta device from its config (its config
    holds the latent scaling the training inputs use; its weights are never read)."""
    out: dict[str, Any] = {}
    for name, entry in read_model_index(root).items():
        if name.startswith("_") or not isinstance(entry, list) or name == "scheduler" or name.startswith("transformer"):
            continue
        if name == "vae":
            out[name] = meta_vae(root)
        else:
            out[name] = None
    return out


class PipelineConditionModel(ConditionModel):
    """A condition model that wraps the family's own diffusers pipeline, loaded without its transformer.

    Prompt encoding, latent packing and the like are then the reference pipeline's own methods, so
    training sees exactly the inputs the reference pipeline computes at inference. Subclasses name
    the pipeline class (`pipeline_class = "diffusers:WanPipeline"`) and implement `encode` and
    `training_inputs`.
    """

    pipeline_class: str = ""
    label: str = ""  # the model's name in messages
    # the longest prompt the pipeline's text encoder takes, in tokens (`text_length_limit`; None: no bound here)
    max_text_limit: int | None = None

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        limit = self.text_length_limit(pipe)
        if limit is not None and not 1 <= max_text_length <= limit:
            raise ValueError(
                f"model.max_text_length must be between 1 and {limit} for {self.label or type(self).__name__}'s text "
                f"encoder (its pipeline's limit); got {max_text_length}"
            )
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.max_text_length = max_text_length
        self.timestep_sampling = TimestepConfig()  # the job's `train.timestep` replaces it (FlowMatchingTask)
        self.num_train_timesteps: int = pipe.scheduler.config.num_train_timesteps

    def text_length_limit(self, pipe: Any) -> int | None:
        """The bound of `model.max_text_length` (default `max_text_limit`; a family whose pipeline carries it
        reads it there)."""
        return self.max_text_limit

    @classmethod
    def from_pretrained(
        cls,
        root: str | Path,
        device: torch.device = torch.device("cpu"),
        dtype: torch.dtype = torch.float32,
        max_text_length: int = 512,
        encoders: bool = True,
    ) -> Self:
        # no transformer is loaded here (a two-expert checkpoint has two: transformer, transformer_2)
        transformers = {name: None for name in read_model_index(root) if name.startswith("transformer")}
        skip = {**transformers, **(cls.pipeline_overrides(root) if encoders else encoder_placeholders(root))}
        pipe = import_object(cls.pipeline_class).from_pretrained(root, dtype=dtype, **skip)
        if encoders:
            pipe.to(device)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False).eval()
        model = cls(pipe, torch.device(device), dtype, max_text_length)
        model.read_checkpoint(Path(root))
        return model

    @classmethod
    def pipeline_overrides(cls, root: str | Path) -> dict[str, Any]:
        """`from_pretrained` overrides for components the pipeline cannot load itself here (Qwen-Image-Edit's
        processor, which needs torchvision). Default: none."""
        return {}

    def read_checkpoint(self, root: Path) -> None:
        """Read what the family needs from the checkpoint folder beyond the loaded pipeline (e.g. the
        transformer's config, since the transformer is not loaded here). Default: nothing."""

    @torch.no_grad()
    def vae_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] -> the VAE posterior's mode: deterministic, so conditions can be precomputed."""
        return self.pipe.vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()


class PackedImageConditionModel(PipelineConditionModel):
    """An image family whose transformer takes 2x2-packed latent tokens (Flux, Qwen-Image): image
    pixels checked against VAE factor x 2, latents packed by the pipeline's own `_pack_latents`.
    Subclasses set `label` (for messages) and implement `encode_prompts`, `normalize` and
    `training_inputs`."""

    label: str = ""
    # an editing variant's source-image tokens (`shared.reference_tokens`), appended by its `training_inputs`;
    # None: text-to-image only
    reference_tokens: ReferenceTokens | None = None

    @classmethod
    def vae_downsampling(cls, vae: Any) -> int:
        """The VAE's spatial downsampling, as the family's pipeline computes it."""
        raise NotImplementedError

    @classmethod
    def pixel_grid(cls, root: str | Path) -> PixelGrid:
        multiple = 2 * cls.vae_downsampling(meta_vae(root))  # VAE downsampling x 2x2 packing
        return PixelGrid(multiple, multiple)

    def check_pixel_shape(self, shape: torch.Size) -> None:
        height, width = shape[-2:]
        multiple = 2 * self.pipe.vae_scale_factor  # VAE downsampling x 2x2 packing
        if height % multiple or width % multiple:
            raise ValueError(f"{self.label} needs height and width divisible by {multiple}; got {height}x{width}")

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image pixels [B, C, H, W] in [-1, 1] -> the family's normalized latents [B, c, h, w]."""
        raise NotImplementedError

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, C, 1, H, W] or [B, C, H, W] in [-1, 1] -> normalized VAE latents [B, c, H/s, W/s] (the mode)."""
        pixels = frames_as_images(pixels, self.label)
        self.check_pixel_shape(pixels.shape)
        return self.normalize(pixels)

    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        return {"latents": self.encode_pixels(batch["pixels"]), **self.encode_prompts(batch["caption"])}

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def noisy_pair(
        self, x0: torch.Tensor, generators: list[torch.Generator]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Normalized latents [B, c, h, w] -> (noisy, target, sigmas): per-sample sigmas shifted for the
        packed token count (`image_tokens`), noise drawn in the VAE layout (the element order of the
        pipeline's draw), all from the per-sample generators."""
        _, shift = resolution_shift(self.pipe.scheduler, self.image_tokens(x0))
        sigmas = sample_sigmas(self.timestep_sampling, generators, shift_fn=shift)
        noisy, target = flow_matching_pair(x0, sigmas, generators)
        return noisy, target, sigmas

    def image_tokens(self, x0: torch.Tensor) -> int:
        """The packed token count of normalized latents [B, c, h, w]: (h/2) x (w/2) 2x2 patches (a family whose
        latents come patchified, FLUX.2's, has one token per latent pixel)."""
        return (x0.shape[-2] // 2) * (x0.shape[-1] // 2)

    def target_prediction(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return pred if self.reference_tokens is None else self.reference_tokens.prediction(pred, target)

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)
