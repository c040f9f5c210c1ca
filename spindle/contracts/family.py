"""Family records: what a family registers (`DiTFamily`, `CausalLMFamily`, `VLMFamily`, `OmniFamily`), with
its demo spec (`spindle demo`) and its checkpoint adapter. (What a family declares for the conformance suites is
test data: its folder's `conformance.py`, spindle/models/shared/conformance.py.)

Light (no torch, no diffusers at import), so the CLI can read every family's declarations (e.g. its
sampling options, for `spindle generate` flags) without importing model code; the heavy parts are
dotted paths ("module:attr") resolved by `import_object`. Each record says its `kind`; the kinds to
come (image-conditioned DiT, VLM, omni) are new records here, and the engines dispatch on the task a
record names, never on a family name."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, overload

from spindle.contracts.options import FamilyOptions

if TYPE_CHECKING:  # (the records stay light: no torch at import)
    import torch

    from spindle.contracts.condition import ConditionModel
    from spindle.contracts.stage import InferenceSpec

    # a checkpoint tensor as the model will hold it (spindle.distributed.sharded_load.TensorSource): its global
    # shape and read(region) -> that region's values
    TensorSource = tuple[tuple[int, ...], Callable[[tuple[slice, ...]], torch.Tensor]]


class CheckpointAdapter(Protocol):
    """How a family's checkpoint layout maps onto the model Spindle trains, both ways (torchtitan's
    state-dict adapter): checked before any weights load, converted on load and back on export, so an
    export keeps the input's layout. Reached through the family record, never imported by a task."""

    default_layout: str  # the layout of a checkpoint written from scratch

    def layout(self, folder: str | Path) -> str:
        """The checkpoint folder's validated layout; raises naming the tensor that does not fit."""
        ...

    def loading(self, layout: str) -> AbstractContextManager[None]:
        """Within the block, the load-time conversion of a checkpoint in `layout` is installed (e.g.
        transformers' conversion mapping for a patched class); afterwards it is as it was."""
        ...

    def load_kwargs(self, layout: str) -> dict[str, Any]:
        """Extra `from_pretrained` arguments for a checkpoint in `layout` (e.g. a quantised checkpoint's
        dequantisation on load); {} where the loading context suffices."""
        ...

    def check_loading_info(self, info: dict[str, Any], where: str) -> None:
        """Raise when a load left tensors missing, unexpected or mismatched."""
        ...

    def to_layout(
        self, model: torch.nn.Module | None, state_dict: dict[str, torch.Tensor], layout: str
    ) -> dict[str, torch.Tensor]:
        """The trained state dict in the checkpoint's `layout` (what export writes); `model`: the trained model, or
        None where only the tensors are at hand (a checkpoint's shards rewritten in another layout)."""
        ...

    def load_sources(self, sources: dict[str, TensorSource]) -> dict[str, TensorSource]:
        """Sharded loading: {checkpoint key: (shape, read(region))} -> the same for the model's keys (e.g.
        per-expert tensors read as the fused ones, region by region); keys already in the model's
        layout pass through (spindle.distributed.sharded_load)."""
        ...


@functools.cache
def _lora_pipeline(pipeline: str, loader: str | None) -> Any:
    """diffusers' `pipeline` class, or (a `loader` mixin named) that class with diffusers' mixin, as diffusers
    composes its own pipelines (`class WanPipeline(DiffusionPipeline, WanLoraLoaderMixin)`); one class per pair."""
    import diffusers

    cls = getattr(diffusers, pipeline)
    if loader is None:
        return cls
    mixin = getattr(importlib.import_module("diffusers.loaders"), loader)
    return type(f"{pipeline}With{loader}", (cls, mixin), {})


def import_object(path: str) -> Any:
    """'package.module:attr' -> attr (keeps family registration free of heavy imports)."""
    module, _, attr = path.partition(":")
    loaded = importlib.import_module(module)
    if not hasattr(loaded, attr):
        raise AttributeError(f"{module} defines no {attr} (named by {path!r})")
    return getattr(loaded, attr)


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
    text_tokens: int = 16  # model.max_text_length (a family whose transformer fixes the text length sets it)
    train: dict[str, Any] = field(default_factory=dict)  # more train: keys the family needs (a two-expert: expert)

    def write_data(self, out: Path, seed: int) -> Path:
        path: Path = import_object(self.dataset)(out, seed=seed, **self.dataset_kwargs)
        return path

    def train_config(self, model: Path, data: Path, output_dir: Path, steps: int, seed: int) -> dict[str, Any]:
        return {
            "model": {"path": str(model), "max_text_length": self.text_tokens},
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
                **self.train,
            },
            "checkpoint": {"every_steps": 50, "resume": "none"},
        }


@dataclass(frozen=True)
class TextDemoSpec:
    """`spindle demo` for a causal-LM family: a built-in text corpus, a short fine-tune, a continuation."""

    prompt: str = "the red circle"
    seq_len: int = 64
    max_new_tokens: int = 12

    dataset: str = "spindle.data.synthetic:make_text_corpus"  # "module:function(out, seed=...)" writing JSONL

    def write_data(self, out: Path, seed: int) -> Path:
        path: Path = import_object(self.dataset)(out, seed=seed)
        return path

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


@dataclass(frozen=True)
class DiffusersCheckpoint:
    """The diffusers folders a DiT family serves, as the registry recognises them: model_index.json's
    pipeline `_class_name`, else transformer/config.json's, else `detect` (a renamed local folder)."""

    pipeline: str  # the diffusers pipeline class (model_index.json `_class_name`)
    transformer: str  # the transformer's class (transformer/config.json `_class_name`)
    detect: Callable[[Path], bool] | None = None
    # a variant of a pipeline class another family serves too (Wan2.2 A14B's two-expert WanPipeline):
    # model_index.json -> whether the folder is this variant; the registry tries variants first
    variant: Callable[[dict[str, Any]], bool] | None = None
    # the diffusers LoRA loader mixin (e.g. "HunyuanVideoLoraLoaderMixin") for a stock pipeline class that has
    # none (HunyuanVideo15Pipeline): LoRA files are written and read through the pipeline with it mixed in, the
    # layout diffusers' `load_lora_adapter(..., prefix="transformer")` reads on the stock transformer
    lora_loader: str | None = None


class Code:
    """A piece of a family's code, found in the family's folder by module and name ("module:attribute" under
    its package), as transformers finds a model type's `modeling_<type>.py`. Read on a record: "package.
    module:attribute" (the record's `code` entry where it points elsewhere), or None where the folder has no
    such module."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, family: None, owner: type) -> Code: ...
    @overload
    def __get__(self, family: FamilyFolder, owner: type) -> str | None: ...
    def __get__(self, family: FamilyFolder | None, owner: type) -> Code | str | None:
        return self if family is None else family.code_path(self.name)


class RequiredCode(Code):
    """Code every family of the kind has: checked when the record is made (at registration)."""

    @overload
    def __get__(self, family: None, owner: type) -> Code: ...
    @overload
    def __get__(self, family: FamilyFolder, owner: type) -> str: ...
    def __get__(self, family: FamilyFolder | None, owner: type) -> Code | str | None:
        return self if family is None else family.required_code(self.name)


@functools.cache
def _module_exists(module: str) -> bool:
    """Whether `module` can be imported (found, not imported): a record's code is looked up on every read."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no such package: a record renamed without its folder
        return False


@dataclass(frozen=True)
class FamilyFolder:
    """A family record whose code is its folder's (the `Code` attributes of the record's class, found by
    module and name under `package`, default `spindle.models.<name>`), so a record lists no paths. `code`
    points a piece elsewhere: a family sharing its base's (Wan's LoRA layout), two records in one folder,
    or None for code the family has not."""

    kind: ClassVar[str] = "family"
    name: str
    package: str = field(default="", kw_only=True)  # the family folder's module ("": spindle.models.<name>)
    code: dict[str, str | None] = field(default_factory=dict, kw_only=True)  # Code name -> "module:attribute"
    # every kind has a tiny-checkpoint builder: (out, seed, **overrides) -> a tiny random checkpoint folder
    tiny_model = Code("tiny:build_tiny")

    @classmethod
    def code_names(cls) -> dict[str, Code]:
        """The kind's code: attribute name -> its `Code` (the class's and its bases')."""
        return {name: c for base in reversed(cls.__mro__) for name, c in vars(base).items() if isinstance(c, Code)}

    def __post_init__(self) -> None:
        known = self.code_names()
        if unknown := sorted(set(self.code) - set(known)):
            raise ValueError(f"family {self.name}: unknown code {unknown}; a {self.kind} family's: {sorted(known)}")
        for name, c in known.items():  # at registration, not at first use
            if isinstance(c, RequiredCode):
                self.required_code(name)

    def code_path(self, name: str) -> str | None:
        """ "module:attribute" of the family's `name` code, or None where its folder has no such module."""
        if name in self.code:
            return self.code[name]
        module, _, attr = self.code_names()[name].where.partition(":")
        module = f"{self.package or 'spindle.models.' + self.name}.{module}"
        return f"{module}:{attr}" if _module_exists(module) else None

    def required_code(self, name: str) -> str:
        path = self.code_path(name)
        if path is None:
            module, _, attr = self.code_names()[name].where.partition(":")
            raise ValueError(f"family {self.name} has no {name} ({module}.py defining {attr} in its folder)")
        return path


@dataclass(frozen=True)
class DiTFamily(FamilyFolder):
    """A diffusion transformer family served from a diffusers pipeline folder (model_index.json).

    The record says what is not code; its code is the family folder's (`condition.py`, `inference.py`,
    `tiny.py`, and `lora.py` where the family has an original LoRA layout: the `Code` attributes below)."""

    kind: ClassVar[str] = "dit"
    checkpoint: DiffusersCheckpoint
    options: FamilyOptions = field(default_factory=FamilyOptions)  # sampling options (CLI flags, HTTP fields)
    demo: DemoSpec | None = None
    task: str = "flow_matching"  # the training task (a key of spindle.train.tasks.TASKS)
    extras: dict[str, Any] = field(default_factory=dict)
    # why the family trains without sequence parallelism although its diffusers transformer has a `_cp_plan`
    # "" where the plan (or its absence) says it all. The same
    # field as CausalLMFamily.sequence_parallel_refused: refused before launch with this reason
    sequence_parallel_refused: str = ""
    # why the family runs Ulysses SP (parallel.sp) but not ring attention (parallel.ring), refused before launch
    ring_attention_refused: str = ""
    condition_model = RequiredCode("condition:CONDITION_MODEL")  # its ConditionModel subclass
    inference = Code("inference:INFERENCE")  # its inference spec (spindle.infer)
    # a diffusers-layout LoRA state dict (no "transformer." prefix) -> the same LoRA in the original model's key
    # layout (ComfyUI / the original code); reading back goes through the pipeline class
    lora_original = Code("lora:to_original")

    @property
    def export_hint(self) -> str:
        return f"diffusers.{self.checkpoint.pipeline}.from_pretrained loads it"

    def condition_model_cls(self) -> type[ConditionModel]:
        cls: type[ConditionModel] = import_object(self.condition_model)
        return cls

    def pipeline_class(self) -> Any:
        """The family's diffusers pipeline class (LoRA loading and saving are its classmethods)."""
        import diffusers

        return getattr(diffusers, self.checkpoint.pipeline)

    def lora_pipeline_class(self) -> Any:
        """The class whose diffusers LoRA methods (`save_lora_weights`, `lora_state_dict`, `load_lora_weights`) read
        and write the family's LoRA files: the pipeline class, with `checkpoint.lora_loader` mixed in where the
        stock class has no LoRA loader."""
        return _lora_pipeline(self.checkpoint.pipeline, self.checkpoint.lora_loader)

    def inference_spec(self) -> InferenceSpec:
        if self.inference is None:
            raise NotImplementedError(f"family {self.name!r} has no inference support yet")
        spec: InferenceSpec = import_object(self.inference)
        return spec


@dataclass(frozen=True)
class CausalLMFamily(FamilyFolder):
    """A decoder-only language model family served from a transformers folder (config.json `model_type`).

    `model_class` is the ForCausalLM class the task loads ("module:Class"): the family's patchgen-generated
    class where a patch is needed (its forward takes the same loss arguments as transformers' own). The
    registry resolves a folder to the family listing its `model_type`. Its code is the family folder's
    (`tiny.py`, and `conversion.py` where the checkpoint's layout needs one).
    """

    kind: ClassVar[str] = "causal_lm"
    model_class: str  # "module:Class" of the ForCausalLM to train
    # the transformers `model_type`s of the checkpoints the family serves; () stands for (name,), the family
    # named as its model type (a record derived with dataclasses.replace names its own)
    model_types: tuple[str, ...] = field(default=(), kw_only=True)
    # model types of the family's other checkpoints that it does not train (a Gemma 3 family's image-text
    # folders) -> why, and what it serves instead: the registry refuses such a folder with that reason at
    # detection, before anything loads, instead of "no family serves it"
    refused_model_types: dict[str, str] = field(default_factory=dict, kw_only=True)
    # why Ulysses SP (parallel.sp > 1) cannot train the family's models ("": it can, within the layout checks of
    # spindle.distributed.ulysses_attention); refused before launch with this reason
    sequence_parallel_refused: str = field(default="", kw_only=True)
    # why documents cannot be packed into rows for the family's models ("": they can, unless linear attention,
    # spindle.train.packing): data.packing: true is refused before launch with this reason, and unset resolves
    # to one document per row
    packing_refused: str = field(default="", kw_only=True)
    demo: TextDemoSpec | None = field(default_factory=TextDemoSpec)  # every language model's text demo
    extras: dict[str, Any] = field(default_factory=dict)
    task: str = "causal_lm"  # the training task (a key of spindle.train.tasks.TASKS)
    # its `CheckpointAdapter` (checkpoint layout checks and conversion, e.g. per-expert <-> fused MoE tensors);
    # None (no conversion.py): the checkpoint loads as the model class expects, with no conversion
    checkpoint_adapter = Code("conversion:ADAPTER")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))

    @property
    def export_hint(self) -> str:
        return "transformers.AutoModelForCausalLM.from_pretrained loads it"

    def model_cls(self) -> type:
        cls: type = import_object(self.model_class)
        return cls

    def adapter(self) -> CheckpointAdapter | None:
        """The family's checkpoint adapter, or None when its checkpoints need no conversion."""
        return None if self.checkpoint_adapter is None else import_object(self.checkpoint_adapter)

    def inference_spec(self) -> InferenceSpec:
        raise NotImplementedError(
            f"{self.name} is a language model: Spindle's generate/serve engine runs diffusion models only; "
            "load the exported folder with transformers (AutoModelForCausalLM.from_pretrained) to generate text"
        )


@dataclass(frozen=True)
class VLMFamily(CausalLMFamily):
    """A vision-language model family served from a transformers folder (config.json `model_type`, a
    tokenizer with a chat template, preprocessor_config.json for the image processor): a causal LM
    whose input embeddings carry a vision tower's output, so it shares the causal-LM record's fields.

    `model_class` is the ForConditionalGeneration class. `parts`: the trainable parts by module-name
    prefix (what `train.freeze` names); a parameter belongs to the part with the longest matching prefix,
    so the aligner inside the vision tower's module is its own part. `rope_index` computes a document's
    multimodal (3-D) RoPE positions exactly as the model does, without the model (the data path calls it
    per document).
    """

    kind: ClassVar[str] = "vlm"
    # (config, input_ids [1, L], image_grid_thw, video_grid_thw, second_per_grid_ts) -> [R, 1, L]: the R multimodal
    # RoPE rows of the positions (3 for the Qwen-VL families' 3-D RoPE; 0 for a model with 1-D positions)
    rope_index = RequiredCode("rope:rope_index")
    # the class laying out the family's images (spindle.data.multimodal.GridImages' members, constructed with
    # (model_path, tokenizer, config, options)); None (no images.py): Qwen-VL's patch grid, GridImages
    images = Code("images:IMAGES")
    # "(model, like) -> zero": zero times the vision side's output on its smallest input (the dummy forward of a
    # text-only micro-batch, which must reach every vision parameter); None (no vision.py): Qwen-VL's tower
    vision_dummy = Code("vision:dummy_vision")
    vision_tower: str = "model.visual"  # the vision encoder module (the dummy forward of text-only batches)
    audio_tower: str = ""  # the audio encoder module ("": the model takes no audio; audio parts are refused)
    # "module:function(config, frames) -> int": the decoder tokens of an audio clip of `frames` mel frames;
    # "": Qwen2.5-Omni's encoder (spindle.data.audio.audio_token_count)
    audio_tokens: str = ""
    # the order in which the model's forward runs its towers, by input kind (the dummy forwards keep it)
    tower_order: tuple[str, ...] = ("image", "video")
    language_model: str = "model.language_model"  # the decoder stack (where Ulysses SP splits the sequence)
    # Under Ulysses SP, True: the vision tower's blocks run on each rank's chunk of the patches (a Qwen-VL tower:
    # spindle/distributed/vision_sequence_parallel.py); False: every SP rank runs the whole tower (Gemma 3's
    # SigLIP, a fixed 256 patches an image, no `blocks`/`merger`), each back-propagating its own chunk's loss
    vision_sequence_parallel: bool = True
    parts: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "vision": ("model.visual.",),
            "aligner": ("model.visual.merger.",),
            "language": ("model.language_model.", "lm_head."),
        }
    )
    # True: videos as Qwen3-VL's processor makes them (its frame sampling and clip resize, each temporal patch's
    # timestamp written into the text: spindle.data.video_timestamps); False: as Qwen2-VL's
    video_timestamps: bool = False
    # True: the model's forward takes `token_type_ids` (1 on image tokens), from which it builds its attention mask
    # (Gemma 3: an image's tokens attend to each other both ways); the task passes them from the input ids, and
    # builds the blocks' masks itself for packed rows and under Ulysses SP (spindle/train/tasks/vlm.py mask_inputs)
    token_type_ids: bool = False
    # the other videos' seconds per temporal grid step (mrope time), as the family's stock processor computes it:
    # "sampled_fps": temporal patch / the clip's sampled frame rate (Qwen2_5_VLProcessor); "fps": / data.fps
    video_grid_seconds: str = "sampled_fps"
    task: str = "vlm"
    demo: TextDemoSpec | None = None  # no `spindle demo` for vision-language models yet

    @property
    def export_hint(self) -> str:
        return "transformers.AutoModelForImageTextToText.from_pretrained loads it"

    def rope_index_fn(self) -> Callable[..., torch.Tensor]:
        """(config, input_ids [1, L], image_grid_thw, video_grid_thw, second_per_grid_ts, **model extras) -> the
        document's [R, 1, L] RoPE positions (`rope_index`)."""
        fn: Callable[..., torch.Tensor] = import_object(self.rope_index)
        return fn

    def image_layout(self) -> type | None:
        """The family's image layout class (`images`), or None for Qwen-VL's (the data path's default)."""
        cls: type | None = import_object(self.images) if self.images else None
        return cls

    def audio_tokens_fn(self) -> Callable[[object, int], int] | None:
        """(the model's transformers config, mel frames) -> the decoder tokens of an audio clip (`audio_tokens`)."""
        fn: Callable[[object, int], int] | None = import_object(self.audio_tokens) if self.audio_tokens else None
        return fn

    def part_of(self, param_name: str) -> str | None:
        """The part (a key of `parts`) a parameter belongs to: the longest matching prefix; None: no part."""
        best: tuple[int, str | None] = (0, None)
        for part, prefixes in self.parts.items():
            for prefix in prefixes:
                if param_name.startswith(prefix) and len(prefix) > best[0]:
                    best = (len(prefix), part)
        return best[1]

    def inference_spec(self) -> InferenceSpec:
        raise NotImplementedError(
            f"{self.name} is a vision-language model: Spindle's generate/serve engine runs diffusion models only; "
            "load the exported folder with transformers (AutoModelForImageTextToText.from_pretrained) to generate"
        )


@dataclass(frozen=True)
class OmniFamily(VLMFamily):
    """An omni-modal family (Qwen2.5-Omni): its checkpoint folder holds a whole speech-in/speech-out model, of
    which Spindle trains one sub-model (the *thinker*: audio + vision + text -> text). `model_class` is that
    sub-model's class, which reads its part of the folder (config and tensors) by itself. The tensors under
    `untrained` prefixes (the talker and the speech decoder) are never loaded for training and are written to
    the export byte for byte as they came; `full_model_class` ("module:Class") loads the exported folder."""

    kind: ClassVar[str] = "omni"
    # (config, tokenizer, grid_thw, second_per_grid, audio_tokens, merge_size) -> str: the text a video's pad token
    # becomes when its audio track is used (data.use_audio_in_video); None (no video_audio.py): not supported
    video_audio_layout = Code("video_audio:video_audio_placeholder")
    prefix: str = "thinker."  # the trained sub-model's checkpoint key prefix
    audio_tower: str = "model.audio_tower"  # the thinker's audio encoder (Qwen2.5-Omni's and Qwen3-Omni's)
    tower_order: tuple[str, ...] = ("audio", "image", "video")  # the thinkers' forward runs audio first
    # Qwen2.5-Omni's thinker: what maps each tower's features into the decoder's width is the aligner
    parts: dict[str, tuple[str, ...]] = field(
        default_factory=lambda: {
            "audio": ("model.audio_tower.",),
            "vision": ("model.visual.",),
            "aligner": ("model.visual.merger.", "model.audio_tower.proj."),
            "language": ("model.language_model.", "lm_head."),
        }
    )
    untrained: tuple[str, ...] = ()  # checkpoint key prefixes kept as they came, e.g. ("talker.", "token2wav.")
    # class names of the FSDP2 units (decoder layers, vision blocks, audio encoder layers): the sub-model's
    # `_no_split_modules` also names the whole towers, which would make each tower a single unit
    blocks: tuple[str, ...] = ()
    full_model_class: str = ""
    video_grid_seconds: str = "fps"  # the Qwen-Omni processors: temporal patch / the requested fps
    task: str = "omni"

    @property
    def export_hint(self) -> str:
        return f"transformers.{self.full_model_class.rpartition(':')[2]}.from_pretrained loads it"

    def video_audio_layout_fn(self) -> Callable[..., str]:
        fn: Callable[..., str] = import_object(self.required_code("video_audio_layout"))
        return fn

    def is_untrained(self, checkpoint_key: str) -> bool:
        return checkpoint_key.startswith(self.untrained)
