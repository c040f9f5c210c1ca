"""A family's registration: `DiTFamily` / `CausalLMFamily` and their demo and conformance specs.
Light (no torch, no diffusers at import), so the CLI can read every family's declarations (e.g. its
sampling options, for `spindle generate` flags) without importing model code; the heavy parts are
dotted paths resolved by `import_object`. `spindle.models.base` re-exports these names."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spindle.infer.options import FamilyOptions

if TYPE_CHECKING:
    from spindle.models.base import ConditionModel


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
        import torch

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
    # the 2-process layouts the family trains with, checked equal to one process: "ulysses2"
    # (parallel.sp=2) and "ring2" (parallel.ring=2). A family leaves one out only with the reason.
    sequence_parallel: tuple[str, ...] = ("ulysses2", "ring2")


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
    options: FamilyOptions = field(default_factory=FamilyOptions)  # sampling options (CLI flags, HTTP fields)
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
