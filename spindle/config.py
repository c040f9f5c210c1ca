"""Typed configuration for every Spindle job: YAML file + dotted command-line overrides.

Unknown keys and wrong types fail before any work, naming the key path and, for typos, the
closest valid key. The resolved config is written next to the run's outputs.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from spindle.contracts.request import short_repr


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message names the key and the fix."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptionSection(Section):
    """A section given as keyword options (the Python API: `load_generator(path, cache="fbc")`) or as
    command-line flags generated from its fields (`spindle.commands.flags`), rather than from YAML.
    Strict (no "2" for 2, no True for 1) and frozen. Bad values raise `ConfigError` in one line naming
    the option (a typo: the closest valid one), before any work; `from_values(values, name)` names it
    as the caller spells it (a flag: `--max-steps`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    noun: ClassVar[str] = "option"  # what the error messages call one field ("unknown engine option ...")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            errors = [dict(err) for err in e.errors()]
            raise OptionError(describe_option_errors(errors, type(self)), errors) from None

    @classmethod
    def from_values(cls, values: dict[str, Any], name: Callable[[str], str] = str) -> Any:
        """`cls(**values)` with errors naming each field as `name(field)` spells it."""
        try:
            return cls(**values)
        except OptionError as e:
            raise OptionError(describe_option_errors(e.errors, cls, name), e.errors) from None


class OptionError(ConfigError):
    """A bad option of an `OptionSection`; `errors`: pydantic's error records (to name them another way)."""

    def __init__(self, message: str, errors: list[dict[str, Any]]):
        super().__init__(message)
        self.errors = errors


class ModelConfig(Section):
    path: str = Field(
        description="diffusers pipeline folder (model_index.json) or transformers model folder (config.json), or a "
        "Hugging Face repo id org/name[@revision] in the local cache (spindle.hub)"
    )
    family: str | None = Field(None, description="force a family instead of detecting it from model_index.json")
    sharded_load: bool = Field(
        True,
        description="build the model on the meta device, parallelize it, then read each rank's shards only "
        "(false: every rank loads the whole model first)",
    )
    max_text_length: int = Field(512, ge=1, description="text tokens per prompt (padded/truncated)")
    attn_implementation: Literal[
        "auto", "sdpa", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention"
    ] = Field(
        "auto",
        description="language models' attention (docs/training.md, Attention backends): varlen (per-document "
        "causal SDPA from the position ids, memory linear in the row length, any device), flash_attention_2/3 "
        "(the same through flash-attention's varlen kernel; CUDA, bf16, installed), flex_attention (CUDA), sdpa "
        "(packed rows get a dense [S, S] document mask); auto: the fastest that can run (flash when installed "
        "on CUDA, else varlen; sdpa for sliding-window models). DiT jobs take auto only",
    )
    attention_backend: str = Field(
        "native",
        description="DiTs: diffusers' attention dispatcher backend of the trained transformer (spindle.ops."
        "dit_attention): native (torch SDPA, the default), _native_math / _native_flash (CPU too), flash, "
        "flash_varlen, _flash_3, sage, flex, xformers, _native_cudnn (CUDA, when installed); language models: "
        "model.attn_implementation",
    )


class BucketsConfig(Section):
    """`data.buckets:` aspect-ratio and frame-count buckets (`spindle.data.buckets`); `true` = these defaults."""

    max_aspect: float = Field(2.0, ge=1, description="widest bucket: long side / short side at most this")
    upscale: bool = Field(
        False, description="enlarge sources smaller than their bucket (false: they get a smaller bucket of their own)"
    )
    frames: list[int] | None = Field(
        None, description="frame-count buckets; default: every count the family takes, up to data.num_frames"
    )
    remainder: Literal["pad", "drop"] = Field(
        "pad",
        description="a bucket's last, partial global batch: pad it with repeats of the bucket's samples, or drop it",
    )


class SourceConfig(Section):
    """One entry of `data.sources:` (`spindle.data.sources`)."""

    path: str = Field(description="folder of media + .txt captions, a .jsonl manifest, or a folder of .jsonl shards")
    kind: Literal["video", "image", "both"] = Field("both", description="which media files of the source are used")
    repeats: int = Field(1, ge=1, description="every sample appears this many times per epoch")
    weight: float = Field(
        1.0, gt=0, description="share multiplier: repeats x weight copies per epoch, the fraction drawn anew per epoch"
    )
    name: str | None = Field(None, description="name in the summary and metrics (default: the path's last part)")


class MediaDataConfig(Section):
    """`data:` of DiT (flow-matching) jobs: captioned images/videos."""

    path: str | None = Field(
        None,
        description="folder of media + same-name .txt captions, a .jsonl manifest, or a folder of .jsonl shards "
        "(or give data.sources)",
    )
    control_dir: str | None = Field(
        None,
        description="edit pairs: the folder of source (control) images mirroring data.path (the targets): "
        "stem.png or stem_0.png, stem_1.png, ... per target",
    )
    sources: list[SourceConfig] = Field(
        default_factory=list, description="several datasets mixed, each {path, kind, repeats, weight} (not with path)"
    )
    buckets: bool | BucketsConfig = Field(
        False, description="aspect-ratio and frame-count buckets around resolution / num_frames (true or knobs)"
    )
    caption_dropout: float = Field(
        0.0, ge=0, lt=1, description="probability of training a sample on the empty caption (for CFG)"
    )
    caption_prefix: str = Field("", description="text put before every caption (a trigger word), joined by a space")
    resolution: tuple[int, int] = Field((64, 64), description="[height, width] after resize + center crop")
    num_frames: int = Field(17, ge=1, description="frames sampled per video (images give 1)")
    skip_bad_samples: bool = Field(False, description="log and skip unreadable files instead of failing")
    audio: bool = Field(
        False,
        description="train on each video's audio track too (a family with an audio stream: LTX-2); every clip "
        "must have one and last num_frames at the family's frame rate",
    )
    shuffle: bool = True
    precomputed: str | None = Field(
        None,
        description="folder written by `spindle precompute`: train on cached conditions; text encoders and VAE "
        "are never loaded",
    )

    @model_validator(mode="after")
    def _one_dataset(self) -> MediaDataConfig:
        if (self.path is None) == (not self.sources):
            raise ValueError(
                "data: give data.path (one dataset) or data.sources (a list of {path, kind, repeats, weight}), "
                "not both and not neither"
            )
        return self


class TextDataConfig(Section):
    """`data:` of causal-LM jobs: JSONL text or chat documents."""

    path: str = Field(description='a .jsonl file or a folder of them; lines {"text": ...} or {"messages": [...]}')
    seq_len: int = Field(2048, ge=2, description="tokens per training row (packed or padded)")
    packing: bool | None = Field(
        None,
        description="pack documents into seq_len rows (false: one truncated/padded sample per row); default: true, "
        "false for models whose layers cannot keep packed documents apart (Qwen3.5's linear attention)",
    )
    skip_bad_samples: bool = Field(False, description="log and skip empty/malformed lines instead of failing")
    shuffle: bool = True


class VLMDataConfig(TextDataConfig):
    """`data:` of VLM jobs: image/video conversation JSONL (spindle.data.multimodal)."""

    path: str = Field(
        description='a .jsonl file or a folder of them; lines {"messages": [...]} with image/video content parts, '
        'or {"images": [...], "conversations": [...]} with <image> placeholders; media paths relative to the file'
    )
    min_pixels: int | None = Field(
        None, ge=1, description="image processor's minimum pixels per image (Qwen2-VL video processor's per frame)"
    )
    max_pixels: int | None = Field(
        None, ge=1, description="image processor's maximum pixels per image (Qwen2-VL video processor's per frame)"
    )
    fps: float = Field(2.0, gt=0, description="video frames sampled per second")
    max_frames: int = Field(16, ge=1, description="most frames sampled per video")
    use_audio_in_video: bool = Field(
        False,
        description="omni models: each video's audio track is encoded too, its tokens interleaved with the frames' "
        "(Qwen-Omni's use_audio_in_video; every video needs an audio track)",
    )


class TimestepConfig(Section):
    """`train.timestep:` how flow-matching training draws sigma in (0, 1); the one definition the config and
    the flow-matching math (`spindle.ops.flow_matching.sample_sigmas`) share."""

    scheme: Literal["uniform", "logit_normal", "mode"] = Field(
        "uniform", description="density of the drawn sigmas (diffusers' compute_density_for_timestep_sampling)"
    )
    logit_mean: float = Field(0.0, description="logit_normal: mean of the normal before the sigmoid")
    logit_std: float = Field(1.0, description="logit_normal: standard deviation of the normal before the sigmoid")
    mode_scale: float = Field(1.29, description="mode: the scale of the mode-seeking density")
    shift: float = Field(
        1.0, gt=0, description="SD3/Wan sigma shift s*t / (1 + (s-1)*t) applied after sampling (1: the family's own)"
    )


class LoraConfig(Section):
    """`train.lora:` train low-rank adapters (PEFT) instead of the full transformer."""

    rank: int = Field(16, description="adapter rank r (> 0)")
    alpha: float | None = Field(None, description="LoRA alpha; the update is scaled by alpha / rank (default: rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    targets: list[str] | None = Field(
        None,
        description="module-name suffixes inside the transformer blocks (e.g. [to_q, to_v]); "
        "default: every attention and feed-forward projection (linear layers); a mixture-of-experts model's "
        "fused experts are opt-in: experts.gate_up_proj, experts.down_proj, or experts for both (PEFT "
        "target_parameters; not with parallel.ep > 1)",
    )

    @model_validator(mode="after")
    def _positive_rank(self) -> LoraConfig:
        if self.rank <= 0:
            raise ValueError(f"train.lora.rank must be a positive integer (e.g. 16); got {self.rank}")
        return self


class ValidationConfig(Section):
    """`train.validation:` render samples from the in-training weights every N steps."""

    every_steps: int = Field(0, ge=0, description="render every N optimizer steps (0: never)")
    prompts: list[str] = Field(default_factory=list, description="one sample per prompt")
    seed: int = Field(0, description="fixed seed: the same prompt is comparable across steps")
    num_inference_steps: int = Field(20, ge=1)
    size: tuple[int, int] | None = Field(None, description="[height, width]; default: data.resolution")
    num_frames: int | None = Field(None, ge=1, description="video families; default: data.num_frames")
    guidance_scale: float | None = Field(None, description="default: the family's sampling default")
    use_ema: bool | None = Field(
        None,
        description="render with the EMA of the weights (needs train.ema) instead of them; default: what the "
        "export holds (the EMA when export.weights resolves to ema), so the samples show what the export gives",
    )
    images: list[str | list[str]] = Field(
        default_factory=list,
        description="image-conditioned families (image-to-video, image edits): the conditioning image of each "
        "prompt (one entry per prompt), or a list of images for a request that takes several (a first-last-frame "
        "Wan's [first, last], Qwen-Image-Edit-Plus's references)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the family's sampling options for every sample (e.g. FLUX.1 Kontext's max_area, auto_resize); "
        "checked before launch",
    )


class EmaConfig(Section):
    """`train.ema:` keep an exponential moving average of the trained weights (`spindle.train.ema`).
    `train.ema: true` takes these defaults."""

    decay: float = Field(
        0.999,
        gt=0,
        lt=1,
        description="weight of the previous average at each update, in (0, 1): ema = decay * ema + (1 - decay) * "
        "weights; it averages over about every / (1 - decay) steps (0.999 and every 1: the last ~1000 steps)",
    )
    start_step: int = Field(
        0, ge=0, description="until this optimizer step the average is the weights themselves; it averages after"
    )
    every: int = Field(1, ge=1, description="update the average every N optimizer steps after start_step")


class TrainConfig(Section):
    output_dir: str = "outputs/run"
    max_steps: int = Field(100, ge=1)
    global_batch_size: int = Field(1, ge=1, description="samples per optimizer step over all data-parallel ranks")
    micro_batch_size: int = Field(1, ge=1, description="samples per forward on one rank")
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor as a fraction of lr")
    grad_clip: float = Field(1.0, ge=0, description="max grad norm; 0 disables clipping")
    seed: int = 0
    gradient_checkpointing: bool = False
    compile: bool = Field(
        False,
        description="regional torch.compile of each repeated block (after SP and activation checkpointing, "
        "before FSDP2); the first steps pay the compilation",
    )
    keep_freed_memory: bool = Field(
        False,
        description="on CPU, keep freed host memory in the process instead of returning it to the OS "
        "(spindle.cpu_allocator): fewer page faults in the first steps, but a fragmented heap that never "
        "shrinks (2.5x the peak RSS measured on a 0.34B Wan LoRA run); off: freed memory goes back at once",
    )
    mixed_precision: Literal["auto", "no", "bf16"] = Field("auto", description="auto: bf16 on CUDA, fp32 on CPU")
    frozen_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="storage dtype of frozen parameters (a LoRA run's base weights, frozen towers); auto: the compute "
        "precision (bf16 under mixed_precision bf16, else fp32), except that with FSDP2 (several processes or "
        "cpu_offload) an fp32 run keeps a weight the checkpoint stores in bf16/fp16 in that dtype and upcasts it "
        "at each block's all-gather (same numbers, half the memory); bfloat16 needs mixed_precision bf16",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state live in host memory, "
        "copied to the device per block for forward and backward (for models bigger than the device)",
    )
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    timestep: TimestepConfig = TimestepConfig()
    log_every: int = Field(1, ge=1)
    lora: LoraConfig | None = Field(None, description="train LoRA adapters only (see LoraConfig)")
    ema: EmaConfig | None = Field(
        None,
        description="keep an EMA of the trained weights (see EmaConfig); true: the defaults; with LoRA, of the "
        "adapters",
    )
    validation: ValidationConfig = ValidationConfig()
    tensorboard: bool = Field(True, description="write TensorBoard event files (when tensorboard is installed)")

    @field_validator("validation", mode="before")
    @classmethod
    def _validation_off(cls, value: Any) -> Any:
        """`train.validation: null` -> no validation (the defaults: every_steps 0), as `train.lora: null` is no LoRA."""
        return {} if value is None else value

    @field_validator("ema", mode="before")
    @classmethod
    def _ema_switch(cls, value: Any) -> Any:
        """`train.ema: true` -> the defaults, `false` -> off (a mapping gives the keys)."""
        if value is True:
            return {}
        if value is False:
            return None
        if value is not None and not isinstance(value, dict | EmaConfig):
            hint = f"; for a decay of {value}, set train.ema.decay={value}" if isinstance(value, float) else ""
            raise ValueError(
                f"train.ema must be true, false or a mapping of decay, start_step, every (e.g. {{decay: 0.999}}); "
                f"got {value!r}{hint}"
            )
        return value


class CheckpointConfig(Section):
    every_steps: int = Field(
        500,
        ge=0,
        description="save a resumable checkpoint every N steps, and always at the end and when SIGTERM / SIGINT "
        "stops the run (0: only then)",
    )
    resume: str = Field(
        "auto",
        description="auto (latest in output_dir; refused when a key that defines the run changed) | force "
        "(latest, whatever changed) | none (start over; refused in a folder holding checkpoints) | path to a "
        "checkpoint folder",
    )
    keep_last: int = Field(2, ge=1, description="resumable checkpoints kept on disk")
    export: bool = Field(True, description="export the model's standard folder (diffusers / transformers) at the end")


class ExportConfig(Section):
    merge_lora: bool = Field(False, description="with train.lora: also write the full pipeline with the LoRA fused")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the exported weights; auto: each tensor as the input checkpoint stored it "
        "(bf16 in -> bf16 out; new tensors such as LoRA adapters in the checkpoint's main dtype)",
    )
    weights: Literal["trained", "ema", "both"] | None = Field(
        None,
        description="which weights the export holds (ema and both need train.ema): trained; ema (the EMA in their "
        "place); both (the trained ones, and the EMA beside them: transformer_ema/ or lora_ema/ in a DiT pipeline, "
        "ema/ in a transformers folder); default: ema with train.ema, else trained",
    )


class ParallelConfig(Section):
    dp_replicate: int = Field(1, ge=1, description="HSDP replica groups")
    dp_shard: int = Field(-1, description="FSDP2 shard degree; -1 = the rest of the world")
    sp: int = Field(1, ge=1, description="Ulysses sequence-parallel degree (attention heads must divide it)")
    ring: int = Field(1, ge=1, description="ring-attention degree; the sequence is split over ring x sp ranks (USP)")
    ep: int = Field(1, ge=1, description="expert-parallel degree (MoE models): experts split over ep ranks of dp_shard")


# ---------------------------------------------------------------- post-training objectives
# One top-level section per objective (`dpo:`, `reward:`, `grpo:`), read when `train.objective` names it; the
# losses are `spindle.train.objectives`. Defaults are TRL 1.16's (tests/project/test_objective_config.py).


class DPOConfig(Section):
    """`dpo:` direct preference optimisation on preference pairs (`spindle.train.objectives.dpo`)."""

    beta: float = Field(
        0.1,
        gt=0,
        description="how far the policy may move from the reference: the implicit reward is beta x the log-ratio "
        "(ipo: the regularisation tau; simpo: the reward scale)",
    )
    loss_type: Literal["sigmoid", "ipo", "simpo"] = Field(
        "sigmoid",
        description="sigmoid (DPO), ipo (squared loss on per-token log-ratios), or simpo (reference-free: average "
        "log-probabilities and a target margin gamma; no reference model is loaded)",
    )
    gamma: float | None = Field(
        None, ge=0, description="simpo only: the target reward margin (default 0.5, TRL's simpo_gamma)"
    )
    rpo_alpha: float | None = Field(
        None,
        ge=0,
        description="add rpo_alpha x the chosen completions' negative log-likelihood (mean over their tokens): "
        "RPO, which keeps the chosen answers likely",
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="sigmoid / simpo: the assumed probability that a pair's preference is flipped (conservative "
        "DPO); not with ipo",
    )
    reference_model: str | None = Field(
        None,
        description="a folder of the same family to use as the frozen reference; default: the starting policy "
        "(a LoRA run: the base with its adapters switched off; a full fine-tune: a frozen copy sharded like it)",
    )
    precompute_reference: bool = Field(
        False,
        description="compute the reference log-probabilities of every pair once before training (cached, refused "
        "when the data, model or settings changed), so no reference model is held during training",
    )
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        description="a longer prompt keeps its last max_prompt_length tokens; then prompt + completion is cut to "
        "data.seq_len (pairs whose prompt alone fills it are dropped and counted)",
    )

    @model_validator(mode="after")
    def _applies(self) -> DPOConfig:
        if self.loss_type == "ipo" and self.label_smoothing:
            raise ValueError("dpo.label_smoothing does not apply to dpo.loss_type ipo (a squared loss); set it to 0")
        if self.gamma is not None and self.loss_type != "simpo":
            raise ValueError(
                f"dpo.gamma is simpo's target margin; dpo.loss_type {self.loss_type} does not use it: remove it"
            )
        if self.loss_type == "simpo" and (self.reference_model is not None or self.precompute_reference):
            raise ValueError(
                "dpo.loss_type simpo is reference-free: remove dpo.reference_model and dpo.precompute_reference"
            )
        return self

    @property
    def simpo_gamma(self) -> float:
        """`gamma` resolved (simpo's default target margin)."""
        return 0.5 if self.gamma is None else self.gamma


class RewardConfig(Section):
    """`reward:` a reward model trained on preference pairs (`spindle.train.objectives.reward`)."""

    use_margin: bool = Field(
        True,
        description='subtract each pair\'s "margin" column (when the data has one) inside the Bradley-Terry loss, '
        "so chosen must beat rejected by it; false: the column is ignored",
    )
    center_rewards_coefficient: float | None = Field(
        None,
        ge=0,
        description="add this x the mean squared sum of the pair's two scores, keeping scores centred on 0 "
        "(TRL's center_rewards_coefficient; 0.01 is typical)",
    )


# ---------------------------------------------------------------- rewards (flow_grpo.rewards, grpo.rewards)
# An entry is a mapping (`{fn: "rewards.py:brightness", weight: 1.0}`) or a string, read as: `http://...` /
# `https://...` an HTTP scorer; `builtin:NAME` a built-in; `path/to/file.py:function` or `module:function` a
# function; anything else (no colon) a reward-model folder. Weights come from each entry's `weight` or from the
# section's `reward_weights` list (one per entry), not both. `spindle.train.rewards` loads them.

Builtin = Literal["jpeg_compressibility", "jpeg_incompressibility", "clip_score"]
RewardKind = Literal["dit", "lm"]  # what the rewards score: decoded images/videos, or text completions
REWARD_SOURCES = ("fn", "model", "url", "builtin")
REWARD_HTTP_FIELDS = ("timeout_s", "retries", "backoff_s", "concurrency")


class RewardSpec(Section):
    """One reward: exactly one of `fn`, `model`, `url`, `builtin`, and its weight."""

    fn: str | None = Field(
        None,
        description="a Python function, `path/to/file.py:function` (relative to the working directory) or "
        "`module:function`: fn(images, prompts, **columns) for DiT models, fn(prompts, completions, **columns) "
        "for language models, returning one float per sample",
    )
    model: str | None = Field(
        None,
        description="language models: a reward-model folder (transformers AutoModelForSequenceClassification, "
        "num_labels 1) scoring prompt + completion",
    )
    url: str | None = Field(
        None,
        description="an HTTP scorer: POST of JSON {prompts, images (base64 PNGs; a video: a list of frames) or "
        "completions, columns}, answering {scores: [one float per sample]}",
    )
    builtin: Builtin | None = Field(
        None,
        description="DiT models: jpeg_compressibility (minus the JPEG size in kB, DDPO's), jpeg_incompressibility "
        "(the size), clip_score (prompt-image cosine similarity of a local CLIP, `clip_model`)",
    )
    clip_model: str | None = Field(None, description="builtin clip_score: a local transformers CLIP folder")
    weight: float = Field(1.0, description="the reward's weight in the summed reward (the per-reward means are logged)")
    name: str | None = Field(
        None, description="the name in metrics (reward/NAME); default: the function's, built-in's or folder's name"
    )
    batch_size: int = Field(
        8, ge=1, description="samples per call of a model (reward model, CLIP) or per request (HTTP scorer)"
    )
    timeout_s: float = Field(60.0, gt=0, description="HTTP scorer: seconds to wait for one answer")
    retries: int = Field(3, ge=0, description="HTTP scorer: tries after a failed one (connection error, timeout, 5xx)")
    backoff_s: float = Field(1.0, ge=0, description="HTTP scorer: wait before the first retry, doubled after each")
    concurrency: int = Field(4, ge=1, description="HTTP scorer: requests in flight at once")

    @model_validator(mode="after")
    def _one_source(self) -> RewardSpec:
        given = [k for k in REWARD_SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"a reward needs exactly one of {', '.join(REWARD_SOURCES)}; got {', '.join(given) if given else 'none'} "
                "(e.g. {fn: rewards.py:brightness} or {builtin: jpeg_compressibility})"
            )
        if (self.builtin == "clip_score") != (self.clip_model is not None):
            raise ValueError(
                "builtin clip_score needs clip_model: a local transformers CLIP folder"
                if self.builtin == "clip_score"
                else "clip_model is the folder of builtin clip_score; remove it or set builtin: clip_score"
            )
        stray = [k for k in REWARD_HTTP_FIELDS if k in self.model_fields_set] if self.url is None else []
        if stray:
            raise ValueError(f"{', '.join(stray)} configure an HTTP scorer (url); this reward has none")
        return self

    @property
    def source(self) -> str:
        """The entry as a user reads it in messages: the spec string."""
        return next(f"{k}: {getattr(self, k)}" for k in REWARD_SOURCES if getattr(self, k) is not None)


def parse_reward(value: Any) -> Any:
    """A string entry as the mapping it stands for (other values as they are, for pydantic to check)."""
    if not isinstance(value, str):
        return value
    if value.startswith(("http://", "https://")):
        return {"url": value}
    if value.startswith("builtin:"):
        return {"builtin": value.removeprefix("builtin:")}
    if ":" in value:
        return {"fn": value}
    return {"model": value}


def _reward_entries(value: Any) -> Any:
    return [parse_reward(v) for v in value] if isinstance(value, list) else value


RewardList = Annotated[list[RewardSpec], BeforeValidator(_reward_entries)]


def weighted_rewards(rewards: list[RewardSpec], weights: list[float] | None, where: str) -> list[RewardSpec]:
    """`rewards` with the section's `reward_weights` applied (checked: one per reward, and no reward
    weighted twice); `where` is the section's name in messages ("flow_grpo")."""
    if weights is None:
        return rewards
    if len(weights) != len(rewards):
        raise ValueError(
            f"{where}.reward_weights has {len(weights)} entries for {len(rewards)} rewards; give one weight per reward"
        )
    both = [i for i, r in enumerate(rewards) if "weight" in r.model_fields_set]
    if both:
        raise ValueError(
            f"{where}.rewards[{both[0]}] sets its own weight and {where}.reward_weights gives one too; keep one of them"
        )
    return [r.model_copy(update={"weight": w}) for r, w in zip(rewards, weights, strict=True)]


def check_reward_kind(rewards: list[RewardSpec], kind: RewardKind, where: str) -> None:
    """Refuse a reward the model kind cannot produce inputs for, naming the entry."""
    for i, r in enumerate(rewards):
        if kind == "dit" and r.model is not None:
            raise ValueError(
                f"{where}.rewards[{i}] ({r.source}) is a reward-model folder, which scores text (language models); "
                "a DiT model's rewards are functions, HTTP scorers or built-ins (a string without ':' reads as a "
                "folder: write path/to/file.py:function for a function)"
            )
        if kind == "lm" and r.builtin is not None:
            raise ValueError(
                f"{where}.rewards[{i}] (builtin: {r.builtin}) scores images; a language model's rewards are "
                "functions, reward-model folders or HTTP scorers"
            )


class GRPOConfig(Section):
    """`grpo:` online GRPO: sample completions, score them, optimise the clipped objective
    (`spindle.train.objectives.grpo`). `train.global_batch_size` counts prompts."""

    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (a group)")
    max_new_tokens: int = Field(
        512, ge=1, description="most tokens generated per completion (dr_grpo normalises by it)"
    )
    max_prompt_length: int | None = Field(
        None, ge=1, description="a longer prompt keeps its last max_prompt_length tokens (counted)"
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the log-probabilities use it too)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the top tokens of this mass")
    rewards: RewardList = Field(
        default_factory=list,
        description="the rewards, each `path/to/file.py:function` or `module:function` (a callable "
        "fn(prompts, completions, **columns) -> list[float]), a reward-model folder, an http(s) URL, or a mapping "
        "{fn|model|url, weight, name, ...} (docs/post-training.md)",
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward (instead of each reward's own weight); default 1 each"
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="divide each advantage by the reward standard deviation of its group, of the batch, or not "
        "at all (Dr. GRPO's choice)",
    )
    epsilon: float = Field(0.2, gt=0, description="clip the probability ratio below at 1 - epsilon")
    epsilon_high: float | None = Field(
        None, gt=0, description="clip the ratio above at 1 + epsilon_high (default: epsilon; DAPO uses 0.28)"
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="optimizer steps per batch of completions (the ratio's old policy is the sampler); "
        "train.max_steps and checkpoint.every_steps must be multiples of it",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="dapo: token mean over the global batch; grpo: mean of per-completion token means; "
        "dr_grpo: token sum / (completions x max_new_tokens)",
    )
    beta: float = Field(
        0.0, ge=0, description="weight of the KL to the reference (k3 estimator); 0 loads no reference model"
    )

    @model_validator(mode="after")
    def _rewards(self) -> GRPOConfig:
        check_reward_kind(self.reward_configs, "lm", "grpo")
        return self

    @property
    def reward_configs(self) -> list[RewardSpec]:
        """The rewards with `reward_weights` applied (what `load_rewards` takes)."""
        return weighted_rewards(self.rewards, self.reward_weights, "grpo")


class FlowGrpoConfig(Section):
    """`flow_grpo:` Flow-GRPO (DanceGRPO for video families): each step samples `num_generations` outputs per
    prompt with the SDE sampler, scores them with `rewards`, and optimises the clipped objective on
    group-relative advantages. Defaults are the Flow-GRPO repository's."""

    num_generations: int = Field(
        8, ge=2, description="samples per prompt, one group (advantages are relative to the group's rewards)"
    )
    num_inference_steps: int = Field(10, ge=1, description="denoising steps of a rollout (the SDE sampler's)")
    noise_level: float = Field(
        0.7,
        gt=0,
        description="the SDE sampler's noise: std_dev_t = noise_level * sqrt(sigma / (1 - sigma)); 0 would be the "
        "deterministic sampler, which has no log-probability",
    )
    guidance_scale: float | None = Field(
        None,
        description="the rollouts' guidance scale, as the family's sampling reads it (CFG, or a "
        "guidance-distilled model's embedded guidance); default: the family's sampling default",
    )
    clip_range: float = Field(
        1e-4, gt=0, description="PPO clip: the probability ratio is clipped to [1 - clip_range, 1 + clip_range]"
    )
    adv_clip_max: float = Field(5.0, gt=0, description="advantages are clamped to [-adv_clip_max, adv_clip_max]")
    num_iterations: int = Field(
        1, ge=1, description="policy updates on each batch of rollouts (1: on-policy; ratios start at 1)"
    )
    timestep_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the fraction of a rollout's denoising steps the loss covers, from the first (noisiest) one",
    )
    beta: float = Field(
        0.0,
        ge=0,
        description="weight of the KL to the reference (the starting weights; LoRA: the base with adapters off); "
        "0: no reference forward",
    )
    global_std: bool = Field(
        False, description="normalise advantages by the whole batch's reward std instead of each group's"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="the family's sampling options for every rollout (e.g. negative_prompt, Qwen-Image's "
        "true_cfg_scale, FLUX.1 Kontext's max_area); checked before launch",
    )
    rewards: RewardList = Field(
        default_factory=list,
        description="the rewards, each `path/to/file.py:function`, `module:function`, an http(s) URL, "
        "`builtin:NAME`, or a mapping {fn|url|builtin, weight, name, ...} (docs/post-training-dit.md)",
    )
    reward_weights: list[float] | None = Field(
        None, description="one weight per reward (instead of each reward's own weight); default 1 each"
    )

    @model_validator(mode="after")
    def _rewards(self) -> FlowGrpoConfig:
        check_reward_kind(self.reward_configs, "dit", "flow_grpo")
        return self

    @property
    def reward_configs(self) -> list[RewardSpec]:
        """The rewards with `reward_weights` applied (what `load_rewards` takes)."""
        return weighted_rewards(self.rewards, self.reward_weights, "flow_grpo")


class DiffusionDpoConfig(Section):
    """`diffusion_dpo:` Diffusion-DPO on preference pairs, in its flow-matching form."""

    beta: float = Field(
        100.0,
        gt=0,
        description="the DPO temperature on the difference of the policy's and the reference's flow-matching "
        "errors (Flow-GRPO's DPO baseline: 100); larger: a sharper preference, a smaller step off the reference",
    )


class TrainJobConfig(Section):
    """The sections every training job has; `data:` is typed by the job's task (`JOB_CONFIGS`)."""

    model: ModelConfig
    data: Any = Field(description="the task's data section (see JOB_CONFIGS)")
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    parallel: ParallelConfig = ParallelConfig()
    export: ExportConfig = ExportConfig()

    @model_validator(mode="after")
    def _batch_sizes(self) -> TrainJobConfig:
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be a multiple of "
                f"train.micro_batch_size ({self.train.micro_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _ema_users(self) -> TrainJobConfig:
        """What reads the EMA needs one kept."""
        if self.train.ema is not None:
            return self
        if self.export.weights in ("ema", "both"):
            raise ValueError(
                f"export.weights={self.export.weights} needs an EMA of the weights; set train.ema: true (or a mapping "
                "of decay, start_step, every), or export.weights: trained"
            )
        if self.train.validation.use_ema:
            raise ValueError(
                "train.validation.use_ema: true needs an EMA of the weights; set train.ema: true, or remove use_ema"
            )
        return self

    @property
    def export_weights(self) -> str:
        """`export.weights` resolved: its default follows `train.ema`."""
        return self.export.weights or ("ema" if self.train.ema is not None else "trained")

    @property
    def validate_with_ema(self) -> bool:
        """`train.validation.use_ema` resolved: by default the weights the export holds (the EMA when
        `export.weights` is ema), so the samples the user watches come from what they will get."""
        use = self.train.validation.use_ema
        return self.export_weights == "ema" if use is None else use


class DiTTrainConfig(TrainConfig):
    objective: Literal["flow_matching", "diffusion_dpo", "flow_grpo"] = Field(
        "flow_matching",
        description="what the step optimises (spindle.train.objectives): flow_matching, the velocity loss on media "
        "and their conditions; diffusion_dpo, Diffusion-DPO on preference pairs (data.path: a pairs JSONL; "
        "settings in diffusion_dpo:); flow_grpo, online Flow-GRPO on samples the engine generates from prompts "
        "(data.path: a prompts JSONL; settings and rewards in flow_grpo:)",
    )
    expert: Literal["high_noise", "low_noise"] | None = Field(
        None,
        description="two-expert checkpoints (Wan2.2 A14B): the expert to fine-tune, high_noise (transformer, "
        "timesteps >= boundary_ratio x 1000) or low_noise (transformer_2, below it); its timesteps are drawn "
        "within that range and the export rewrites only its folder",
    )


def require_rewards(objective: str, rewards: list[RewardSpec], example: str) -> None:
    """An online objective scores its samples: its section's `rewards` must name at least one."""
    if not rewards:
        raise ValueError(
            f"train.objective={objective} needs rewards: {objective}.rewards is empty; give at least one "
            f"(e.g. {objective}.rewards: [{example}])"
        )


class DiTJobConfig(TrainJobConfig):
    """A flow-matching (DiT) job."""

    data: MediaDataConfig
    train: DiTTrainConfig = DiTTrainConfig()
    flow_grpo: FlowGrpoConfig = FlowGrpoConfig()  # read when train.objective is flow_grpo
    diffusion_dpo: DiffusionDpoConfig = DiffusionDpoConfig()  # read when train.objective is diffusion_dpo

    @model_validator(mode="after")
    def _flow_grpo_rewards(self) -> DiTJobConfig:
        if self.train.objective == "flow_grpo":
            require_rewards("flow_grpo", self.flow_grpo.rewards, "rewards.py:brightness")
        return self

    @model_validator(mode="after")
    def _lm_attention_only(self) -> DiTJobConfig:
        if self.model.attn_implementation != "auto":
            raise ValueError(
                f"model.attn_implementation={self.model.attn_implementation} applies to language models; DiT "
                "training runs diffusers' attention; remove it"
            )
        return self


class LMTrainConfig(TrainConfig):
    objective: Literal["sft", "dpo", "reward", "grpo"] = Field(
        "sft",
        description="what the step optimises (spindle.train.objectives): sft, next-token loss on the documents' "
        "label tokens; dpo, direct preference optimisation on preference pairs (settings: the dpo: section); reward, a "
        "reward model (a scalar head, Bradley-Terry loss) on preference pairs (the reward: section); grpo, "
        "online GRPO from reward functions on completions sampled from the policy (the grpo: section)",
    )


class CausalLMJobConfig(TrainJobConfig):
    """A causal-LM (next-token) job."""

    @model_validator(mode="after")
    def _dit_attention_only(self) -> CausalLMJobConfig:
        if self.model.attention_backend != "native":
            raise ValueError(
                f"model.attention_backend={self.model.attention_backend} is a DiT setting (diffusers' dispatcher); "
                "language models choose model.attn_implementation"
            )
        return self

    data: TextDataConfig
    train: LMTrainConfig = LMTrainConfig()
    dpo: DPOConfig = DPOConfig()  # read when train.objective is dpo
    reward: RewardConfig = RewardConfig()  # read when train.objective is reward
    grpo: GRPOConfig = GRPOConfig()  # read when train.objective is grpo

    @model_validator(mode="after")
    def _grpo_rewards(self) -> CausalLMJobConfig:
        if self.train.objective == "grpo":
            require_rewards("grpo", self.grpo.rewards, "rewards.py:correct")
        return self


VLMPart = Literal["audio", "vision", "aligner", "language"]


class VLMLoraConfig(LoraConfig):
    """`train.lora:` of a vision-language (or omni) job: LoRA adapters on the parts `parts` names."""

    parts: list[VLMPart] = Field(
        default_factory=lambda: list[VLMPart](["language"]),
        min_length=1,
        description="the family's parts (as train.freeze names them) that get adapters: language (the decoder "
        "layers), vision (the vision tower's blocks: attention qkv/proj and MLP), aligner (the merger into the "
        "language model), audio (the audio encoder's layers, omni models); default [language]; train.lora.targets "
        "selects among their linear layers",
    )


class VLMTrainConfig(LMTrainConfig):
    lora: VLMLoraConfig | None = Field(
        None, description="train LoRA adapters only (see LoraConfig; parts: which parts get them)"
    )
    freeze: list[VLMPart] = Field(
        default_factory=list,
        description="parts that are not trained (no gradient, no optimizer state): vision (the vision tower), "
        "audio (the audio encoder, omni models), aligner (what maps tower features into the language model), "
        "language (the language model and its head); with train.lora, which freezes every base weight, a "
        "freeze list must name every part that train.lora.parts does not adapt",
    )


class VLMJobConfig(CausalLMJobConfig):
    """A vision-language model job (next-token loss on image/video conversations)."""

    data: VLMDataConfig
    train: VLMTrainConfig = VLMTrainConfig()


class ModelSection(Section):
    """Only the `model:` section of a job (what the entry point reads to find the family, hence the schema)."""

    model_config = ConfigDict(extra="ignore")
    model: ModelConfig


# ---------------------------------------------------------------- loading and errors


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Valid key names of the section that `loc` points into (for did-you-mean)."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        # `Section | None` (optional sections such as train.lora): look inside the union
        ann = next((a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


# names other training tools use for a key, for did-you-mean where spelling alone finds nothing
KNOWN_ALIASES: dict[str, str] = {
    "learning_rate": "lr",
    "lr_scheduler": "lr_schedule",
    "lr_scheduler_type": "lr_schedule",
    "scheduler": "lr_schedule",
    "batch_size": "global_batch_size",
    "train_batch_size": "global_batch_size",
    "per_device_train_batch_size": "micro_batch_size",
    "num_train_steps": "max_steps",
    "steps": "max_steps",
    "gradient_clipping": "grad_clip",
    "max_grad_norm": "grad_clip",
    "warmup": "warmup_steps",
    "output": "output_dir",
    "precision": "mixed_precision",
    "max_seq_len": "seq_len",
    "max_length": "seq_len",
    "cutoff_len": "seq_len",
}


def _describe(err: dict[str, Any], root: type[BaseModel]) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    if not loc and err["type"] == "value_error":
        # a check across sections (a model validator): its message names the keys; the input is the whole config
        return str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        valid = _fields_at(root, loc)
        alias = KNOWN_ALIASES.get(str(loc[-1]))
        close = [alias] if alias in valid else difflib.get_close_matches(str(loc[-1]), valid, n=1)
        hint = f"; did you mean '{'.'.join(map(str, (*loc[:-1], close[0])))}'?" if close else ""
        return f"unknown key '{key}'{hint} (valid keys here: {', '.join(valid)})"
    if err["type"] == "missing":
        return f"missing required key '{key}'"
    if err["type"] == "value_error":  # a validator's own message names the key and what it got
        return str(err["msg"]).removeprefix("Value error, ")
    return f"'{key}': {err['msg']} (got {err.get('input')!r})"


_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
_BOUND_KEYS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def describe_option_errors(
    errors: list[dict[str, Any]], model: type[OptionSection], name: Callable[[str], str] = str
) -> str:
    """One line for the errors of an `OptionSection`: `cache must be one of 'fbc', ...; got 'nope'`,
    `unknown engine option 'cahce'; did you mean 'cache'?`."""
    return "; ".join(_describe_option(err, model, name) for err in errors)


def _describe_option(err: dict[str, Any], model: type[OptionSection], name: Callable[[str], str]) -> str:
    key = ".".join(str(p) for p in err["loc"])
    shown = name(key) if key else ""
    kind, ctx = err["type"], err.get("ctx", {})
    got = short_repr(err.get("input"))
    if kind == "extra_forbidden":
        valid = list(model.model_fields)
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"; did you mean {name(close[0])!r}?" if close else ""
        return f"unknown {model.noun} {shown!r}{hint} (valid: {', '.join(map(name, valid))})"
    if kind in _BOUNDS:
        return f"{shown} must be {_BOUNDS[kind]} {ctx[_BOUND_KEYS[kind]]}; got {got}"
    if kind == "literal_error":
        return f"{shown} must be one of {ctx['expected']}; got {got}"
    if kind == "value_error":  # a validator's own message: it names the fields itself (model level) or follows the name
        message = str(ctx.get("error", err["msg"]))
        return f"{shown} {message}" if shown else message
    return f"{shown}: {err['msg'][0].lower()}{err['msg'][1:]}; got {got}"


def validate_config(raw: dict[str, Any], model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        lines = [_describe(dict(err), model) for err in e.errors()]
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (1e-4, true, [64, 64])."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.sub=value (e.g. train.lr=1e-4)")
    key, _, text = override.partition("=")
    value = yaml.safe_load(text) if text.strip() else ""
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _first_duplicate(node: yaml.Node | None, where: tuple[str, ...] = ()) -> tuple[str, int, int] | None:
    """(dotted key, its line, the earlier line) of the first key given twice in one mapping, or None.
    PyYAML keeps the last of two equal keys without a word: a second `train:` section would silently
    replace the first."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges are not duplicates
                continue
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key in seen:
                return ".".join((*where, key)), line, seen[key]
            seen[key] = line
            if (found := _first_duplicate(value_node, (*where, key))) is not None:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            if (found := _first_duplicate(item, (*where, str(i)))) is not None:
                return found
    return None


def parse_yaml(text: str, path: str | Path) -> Any:
    """YAML `text` (from `path`) -> data, with PyYAML's safe loader; a key given twice in one mapping is a
    ConfigError naming it and both lines, as is invalid YAML."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if (duplicate := _first_duplicate(node)) is not None:
            key, line, first = duplicate
            raise ConfigError(
                f"{path}:{line}: '{key}' is given twice (also on line {first}); YAML would keep only the last "
                "one: merge them into one"
            )
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


def load_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} not found")
    raw = parse_yaml(path.read_text(), path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, train:, ...)")
    return raw


def load_raw_config(path: str | Path | dict[str, Any] | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """YAML file (or a mapping of its sections, copied, or nothing) + dotted overrides -> the raw mapping,
    not yet validated."""
    if isinstance(path, dict):
        raw = copy.deepcopy(path)
    else:
        raw = load_raw(path) if path is not None else {}
    for override in overrides:
        apply_override(raw, override)
    return raw


def load_config(path: str | Path | None, overrides: Sequence[str], model: type[BaseModel]) -> Any:
    """YAML file + dotted overrides -> the config validated against `model`. A training job's schema
    follows the family the checkpoint is (its task's `config_class`): `spindle.api.load_job_config`."""
    return validate_config(load_raw_config(path, overrides), model)


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
