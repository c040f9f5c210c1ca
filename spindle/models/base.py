"""The family contracts (DiT, causal LM), and the flow-matching helpers every DiT family shares.

A causal-LM family (`CausalLMFamily`) names the transformers `model_type`s it serves and the
ForCausalLM class to load them with; the causal-LM task (spindle/train/tasks/causal_lm.py) does
the rest. A DiT family provides (see docs/architecture.md):
- a `ConditionModel`: frozen, never-sharded components (text encoders, VAE, scheduler) with
  `encode(batch)` and `training_inputs(conditions, generator)`;
- the transformer: the diffusers class itself, loaded from `root/transformer`;
- inference pieces: a `BeforeDenoisingStage` subclass, callbacks for the shared stages, defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.infer.stages import BeforeDenoisingStage

# The registration types live in the light spindle.models.family (read by the CLI without torch).
from spindle.models.family import (  # noqa: F401
    CausalLMFamily,
    ConformanceSpec,
    DemoSpec,
    DiTFamily,
    TextDemoSpec,
    import_object,
)

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on


def load_transformer(root: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load the diffusers transformer class named in `root/transformer/config.json`."""
    import json

    import diffusers

    tdir = Path(root) / "transformer"
    cfg_path = tdir / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: the checkpoint has no transformer component")
    cls_name = json.loads(cfg_path.read_text())["_class_name"]
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ValueError(f"{cfg_path} names {cls_name!r}, which diffusers {diffusers.__version__} does not provide")
    return cls.from_pretrained(tdir, dtype=dtype)


# ---------------------------------------------------------------- flow matching (shared by families)

TIMESTEP_SCHEMES = ("uniform", "logit_normal", "mode")


@dataclass
class TimestepSampling:
    """How training draws sigma in (0, 1). `shift` applies the SD3/Wan shift s*t / (1 + (s-1)*t)."""

    scheme: str = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float = 1.0
    num_train_timesteps: int = 1000


def sample_sigmas(
    cfg: TimestepSampling,
    generators: list[torch.Generator],
    shift_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One sigma per sample, each drawn from that sample's own generator (see `flow_matching_pair`).

    `shift_fn`: the family's own shift of the drawn sigmas (e.g. Flux's resolution-dependent shift,
    `resolution_shift`); it applies only while the static `cfg.shift` is 1 (an explicit static
    shift in the training config takes precedence).
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling

    if cfg.scheme not in TIMESTEP_SCHEMES:
        raise ValueError(f"unknown timestep scheme {cfg.scheme!r}; choose one of {TIMESTEP_SCHEMES}")
    u = torch.cat(
        [
            compute_density_for_timestep_sampling(
                weighting_scheme=cfg.scheme,
                batch_size=1,
                logit_mean=cfg.logit_mean,
                logit_std=cfg.logit_std,
                mode_scale=cfg.mode_scale,
                generator=g,
            )
            for g in generators
        ]
    ).clamp(0.0, 1.0)
    if shift_fn is not None and cfg.shift == 1.0:
        return shift_fn(u)
    return shift_sigmas(u, cfg.shift)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_matching_pair(
    x0: torch.Tensor, sigmas: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rectified flow: x_t = (1 - s) x0 + s * noise, velocity target = noise - x0.

    Noise comes from one CPU generator per sample, so a sample gets the same noise whichever rank or
    micro-batch it lands on: data-parallel and resumed runs reproduce single-process runs exactly.
    """
    from diffusers.utils.torch_utils import randn_tensor

    noise = randn_tensor(tuple(x0.shape), generator=generators, dtype=torch.float32).to(x0.device, x0.dtype)
    s = sigmas.to(x0.device, x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1.0 - s) * x0 + s * noise, noise - x0


def resolution_shift(scheduler: Any, image_seq_len: int) -> tuple[float, Callable[[torch.Tensor], torch.Tensor]]:
    """Resolution-dependent ("dynamic") shift of a flow-matching scheduler with `use_dynamic_shifting`:
    -> (mu, sigma -> shifted sigma). `mu` is diffusers' `calculate_shift` of the image token count
    between the scheduler config's base/max sequence lengths and shifts (what FluxPipeline passes to
    `set_timesteps`); the shift is the scheduler's own `time_shift`, so training draws sigmas from
    the distribution the sampler walks at this resolution."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    cfg = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    return mu, lambda sigmas: scheduler.time_shift(mu, 1.0, sigmas)


def latent_stats(vae_config: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel latent (mean, std) of a Wan-style 3-D VAE (Wan, Qwen-Image), shaped [1, C, 1, 1, 1]:
    training normalizes with them, inference decoding undoes them."""
    shape = (1, vae_config.z_dim, 1, 1, 1)
    return torch.tensor(vae_config.latents_mean).view(shape), torch.tensor(vae_config.latents_std).view(shape)


def mean_std_scale_shift(vae: Any, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`InferenceSpec.decode_scale_shift` for mean/std VAEs: exactly diffusers' arithmetic,
    `latents / (1 / std) + mean`."""
    mean, std = (x.to(latents.device, latents.dtype) for x in latent_stats(vae.config))
    return 1.0 / std, mean


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


class ConditionModel(ABC):
    """Frozen condition components of a family; pure functions of the data (precomputable)."""

    timestep_sampling: TimestepSampling

    @classmethod
    @abstractmethod
    def from_pretrained(
        cls,
        root: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        max_text_length: int = 512,
        encoders: bool = True,
    ) -> ConditionModel:
        """`encoders=False`: for training on precomputed conditions; only what `training_inputs` needs
        is loaded (never the text encoders' or the VAE's weights), and `encode` cannot run."""

    @abstractmethod
    def encode(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Raw batch {"pixels": [B,C,F,H,W] in [-1,1], "caption": list[str]} -> conditions."""

    @abstractmethod
    def training_inputs(self, conditions: dict[str, torch.Tensor], generators: list[torch.Generator]) -> dict[str, Any]:
        """Conditions + one generator per sample -> transformer forward kwargs + "target" + "sigmas"."""


def encoder_placeholders(root: str | Path) -> dict[str, Any]:
    """from_pretrained overrides that keep a pipeline's encoders out of memory: every model component
    but the scheduler is None, except the VAE, built on the meta device from its config (its config
    holds the latent scaling the training inputs use; its weights are never read)."""
    import diffusers

    from spindle.infer.pipeline import read_model_index

    out: dict[str, Any] = {}
    for name, entry in read_model_index(root).items():
        if name.startswith("_") or not isinstance(entry, list) or name in ("scheduler", "transformer"):
            continue
        if name == "vae":
            vae_cls = getattr(diffusers, entry[1])
            with torch.device("meta"):
                out[name] = vae_cls.from_config(vae_cls.load_config(Path(root) / "vae"))
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

    def __init__(self, pipe: Any, device: torch.device, dtype: torch.dtype, max_text_length: int = 512):
        self.pipe = pipe
        self.device = device
        self.dtype = dtype
        self.max_text_length = max_text_length
        self.timestep_sampling = TimestepSampling(num_train_timesteps=pipe.scheduler.config.num_train_timesteps)

    @classmethod
    def from_pretrained(
        cls,
        root: str | Path,
        device: torch.device = torch.device("cpu"),
        dtype: torch.dtype = torch.float32,
        max_text_length: int = 512,
        encoders: bool = True,
    ) -> Self:
        skip = {} if encoders else encoder_placeholders(root)
        pipe = import_object(cls.pipeline_class).from_pretrained(root, transformer=None, dtype=dtype, **skip)
        if encoders:
            pipe.to(device)
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False).eval()
        return cls(pipe, torch.device(device), dtype, max_text_length)

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

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        b, c, h, w = latents.shape
        return self.pipe._pack_latents(latents, b, c, h, w)


class PipelineBeforeDenoisingStage(BeforeDenoisingStage):
    """A BeforeDenoisingStage around the family's diffusers pipeline, built from the loaded components
    without its transformer (`pipeline_class = "diffusers:FluxPipeline"`): its prompt encoding and
    latent helpers are the reference code (`self.text_pipe`)."""

    pipeline_class: str = ""

    def __init__(self, components: dict[str, Any], spec: Any):
        super().__init__(components, spec)
        parts = {k: v for k, v in components.items() if k != spec.transformer_component}
        self.text_pipe = import_object(self.pipeline_class)(**parts, transformer=None)
        self.transformer = components[spec.transformer_component]
        self.scheduler = components["scheduler"]
        self.vae_scale_factor = self.text_pipe.vae_scale_factor


def check_packed_image_request(params: Any, vae_scale_factor: int, max_sequence_length: int, label: str) -> None:
    """The request checks of a 2x2-packed image family (after the common ones): sizes a multiple of
    VAE factor x 2, no frames, the text length its encoder takes. `RequestError` naming the field."""
    from spindle.infer.request import RequestError, check_int_range, check_size

    multiple = 2 * vae_scale_factor
    check_size(params, multiple, multiple, f"VAE x{vae_scale_factor} x 2x2 packing")
    if params.num_frames not in (None, 1):
        raise RequestError(f"num_frames must be left unset (or 1): {label} generates images; got {params.num_frames!r}")
    check_int_range("max_sequence_length", params.max_sequence_length, minimum=1, maximum=max_sequence_length)
