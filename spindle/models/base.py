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

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11 on


def import_object(path: str) -> Any:
    """'package.module:attr' -> attr (keeps family registration free of heavy imports)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class DemoSpec:
    """What `spindle demo --family NAME` trains on and samples for a DiT family (no family branches
    in the command: it calls `write_data`, `train_config` and `sample` on the family's spec)."""

    dataset: str  # "module:function(out, seed=..., **dataset_kwargs)" writing a captioned media folder
    dataset_kwargs: dict[str, Any] = field(default_factory=dict)
    size: tuple[int, int] = (32, 32)  # (height, width) for training and the sample
    num_frames: int = 1  # data.num_frames (1 for image families)
    sample_suffix: str = ".png"  # ".mp4" for video families
    sample_kwargs: dict[str, Any] = field(default_factory=dict)  # extra generate() arguments

    def write_data(self, out: Path, seed: int) -> Path:
        return import_object(self.dataset)(out, seed=seed, **self.dataset_kwargs)

    def train_config(self, model: Path, data: Path, output_dir: Path, steps: int, seed: int) -> dict[str, Any]:
        return {
            "model": {"path": str(model), "max_text_length": 16},
            "data": {"path": str(data), "resolution": list(self.size), "num_frames": self.num_frames},
            "train": {
                "output_dir": str(output_dir),
                "max_steps": steps,
                "global_batch_size": 4,
                "micro_batch_size": 4,
                "lr": 2e-3,
                "warmup_steps": 10,
                "lr_schedule": "cosine",
                "min_lr_ratio": 0.1,
                "seed": seed,
                "timestep": {"scheme": "logit_normal"},
            },
            "checkpoint": {"every_steps": 50, "resume": "none"},
        }

    def sample(self, export_dir: Path, data: Path, out: Path, seed: int) -> str:
        """Generate from the export with the first caption of the demo data; -> what to print."""
        from spindle.infer.generator import DiffusionGenerator

        caption = sorted(data.glob("*.txt"))[0].read_text().strip()
        path = out / f"sample{self.sample_suffix}"
        gen = DiffusionGenerator.from_pretrained(export_dir)
        result = gen.generate(
            prompt=caption,
            height=self.size[0],
            width=self.size[1],
            num_inference_steps=20,
            seed=seed,
            **self.sample_kwargs,
        )
        result.save(path)
        return (
            f"sample for {caption!r}: {path}\n"
            "  (the tiny checkpoint's VAE and text encoders are random, so the sample shows what the DiT learned\n"
            "   in latent space, not recognisable shapes: the falling loss is the signal)"
        )


@dataclass(frozen=True)
class TextDemoSpec:
    """`spindle demo` for a causal-LM family: a built-in text corpus, a short fine-tune, a continuation."""

    prompt: str = "the red circle"
    seq_len: int = 64
    max_new_tokens: int = 12

    def write_data(self, out: Path, seed: int) -> Path:
        from spindle.testing.synthetic import make_text_corpus

        return make_text_corpus(out, seed=seed)

    def train_config(self, model: Path, data: Path, output_dir: Path, steps: int, seed: int) -> dict[str, Any]:
        return {
            "model": {"path": str(model)},
            "data": {"path": str(data), "seq_len": self.seq_len},
            "train": {
                "output_dir": str(output_dir),
                "max_steps": steps,
                "global_batch_size": 4,
                "micro_batch_size": 4,
                "lr": 3e-3,
                "warmup_steps": 5,
                "lr_schedule": "cosine",
                "min_lr_ratio": 0.1,
                "seed": seed,
            },
            "checkpoint": {"every_steps": 50, "resume": "none"},
        }

    def sample(self, export_dir: Path, data: Path, out: Path, seed: int) -> str:
        """Greedy continuation of `prompt` by stock transformers from the export."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(export_dir)
        model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
        inputs = tok(self.prompt, return_tensors="pt")
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        text = tok.decode(ids[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        (out / "sample.txt").write_text(f"{self.prompt} {text}\n")
        return f"continuation of {self.prompt!r} (greedy, stock transformers on the export): {text!r}"


@dataclass(frozen=True)
class ConformanceSpec:
    """How the conformance suite (spindle/testing/conformance.py) exercises a family.

    `parity_cases`: name -> keyword arguments valid both for the stock diffusers pipeline call and
    for `DiffusionGenerator.generate` (with `seed`), small enough for a CPU test; at least one case
    with classifier-free guidance and one without.
    """

    parity_cases: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class DiTFamily:
    name: str
    pipeline_classes: tuple[str, ...]
    transformer_classes: tuple[str, ...]
    condition_model: str  # "module:Class" of a ConditionModel subclass
    inference: str | None = None  # "module:object" of the family's inference spec (infer/)
    tiny_model: str | None = None  # "module:function(out, seed, **overrides)"
    detect: Callable[[Path], bool] | None = None
    demo: DemoSpec | None = None
    conformance: ConformanceSpec | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    task: str = "flow_matching"  # the training task (spindle.train.tasks.TASKS)
    # "module:function": a diffusers-layout LoRA state dict (no "transformer." prefix) -> the same LoRA in
    # the original model's key layout (ComfyUI / the original code); None: no such export for the family.
    # Reading back goes through the family's diffusers pipeline class (`lora_state_dict`).
    lora_original: str | None = None

    @property
    def export_hint(self) -> str:
        return f"diffusers.{self.pipeline_classes[0]}.from_pretrained loads it"

    def condition_model_cls(self) -> type[ConditionModel]:
        return import_object(self.condition_model)

    def pipeline_class(self) -> Any:
        """The family's diffusers pipeline class (LoRA loading and saving are its classmethods)."""
        import diffusers

        return getattr(diffusers, self.pipeline_classes[0])

    def inference_spec(self) -> Any:
        if self.inference is None:
            raise NotImplementedError(f"family {self.name!r} has no inference support yet")
        return import_object(self.inference)


@dataclass(frozen=True)
class CausalLMFamily:
    """A decoder-only language model family served from a transformers folder (config.json `model_type`).

    `model_class` is the ForCausalLM class the task loads ("module:Class"): the family's patchgen-generated
    class where a patch is needed (its forward takes the same loss arguments as transformers' own). The
    registry resolves a folder to the family listing its `model_type`.
    """

    name: str
    model_types: tuple[str, ...]
    model_class: str  # "module:Class" of the ForCausalLM to train
    tiny_model: str | None = None  # "module:function(out, seed, transformer=overrides)"
    demo: TextDemoSpec | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    task: str = "causal_lm"  # the training task (spindle.train.tasks.TASKS)

    @property
    def export_hint(self) -> str:
        return "transformers.AutoModelForCausalLM.from_pretrained loads it"

    def model_cls(self) -> type:
        return import_object(self.model_class)

    def inference_spec(self) -> Any:
        raise NotImplementedError(
            f"{self.name} is a language model: Spindle's generate/serve engine runs diffusion models only; "
            "load the exported folder with transformers (AutoModelForCausalLM.from_pretrained) to generate text"
        )


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
