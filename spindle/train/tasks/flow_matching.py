"""The flow-matching task for DiT families: media batch -> conditions -> noisy inputs -> velocity loss.

The family's frozen condition model (text encoders, VAE, scheduler; never sharded) turns a batch
into the transformer's inputs and target; the loss lives here so the transformer stays a pure
diffusers module whose `save_pretrained` is diffusers' own. Export is a full diffusers pipeline
folder: the base checkpoint's components with the trained transformer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spindle.config import ConfigError, DiTJobConfig
from spindle.contracts.condition import AudioTrack, ConditionModel
from spindle.contracts.family import DiTFamily
from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.protocols import BatchLoader, ParallelDimsLike
from spindle.contracts.task import Objective, StepOutput, TrainTask
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.mesh import barrier, is_main_process
from spindle.export.diffusers import (
    export_lora,
    export_pipeline_sharded,
    export_pipeline_streamed,
    load_transformer,
    transformer_from_config,
)
from spindle.export.dtypes import export_dtypes
from spindle.model_index import read_model_index
from spindle.train.metrics import count_tokens
from spindle.train.objectives import build_objective
from spindle.train.tasks.base import build_parallel_model, resumable_loader

if TYPE_CHECKING:
    from spindle.data.loader import ResumableLoader
    from spindle.distributed.mesh import Mesh


def trained_component(cfg: DiTJobConfig, family: DiTFamily) -> str:
    """The checkpoint component a job trains: "transformer", or the expert `train.expert` names in a
    two-expert checkpoint (the family's condition model decides; raises for a missing or stray choice)."""
    return family.condition_model_cls().trained_component(
        read_model_index(cfg.model.path, missing_ok=True), cfg.train.expert
    )


def sample_generator(seed: int, step: int, sample_index: int) -> torch.Generator:
    """A per-sample RNG keyed on (seed, step, dataset index).

    Keying on the sample, not on the rank or micro-batch, is what makes a data-parallel run (and a
    resumed run) draw exactly the noise and timesteps of the single-process run, and gives every rank
    of a sequence-parallel group the same draws.
    """
    digest = hashlib.blake2b(f"{seed}:{step}:{sample_index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


@dataclass
class TrainingInputs:
    """One micro-batch's flow-matching inputs on this rank (`FlowMatchingTask.training_inputs`)."""

    model_inputs: dict[str, Any]  # the transformer's keyword arguments
    target: torch.Tensor  # the velocity (or the family's target) the prediction is compared with
    sigmas: torch.Tensor  # [samples] noise levels
    loss_mask: torch.Tensor | None  # elements the loss leaves out (None: all count)
    samples: int
    tokens_per_sample: int
    # the targets of further outputs of the transformer, by output index (LTX-2's audio stream with data.audio:
    # {1: its velocity}); the loss adds each one's per-sample mean
    extra_targets: dict[int, torch.Tensor] = field(default_factory=dict)


class FlowMatchingTask(TrainTask[DiTJobConfig, DiTFamily]):
    name = "flow_matching"
    config_class = DiTJobConfig
    loss_sharded_over_sp = False  # diffusers CP gathers the output: every SP rank holds the whole loss
    # the EMA beside the trained weights in the same pipeline folder: stock diffusers loads it with
    # `<Transformer>.from_pretrained(export, subfolder="transformer_ema")`, or `load_lora_weights(export/lora_ema)`
    ema_beside = {"transformer": "transformer_ema", "lora": "lora_ema", "merged/transformer": "merged/transformer_ema"}

    @classmethod
    def ema_paths(cls, trainer_state: dict[str, Any]) -> dict[str, str]:
        """A two-expert checkpoint's trained expert (`transformer_2`) has its EMA twin `transformer_2_ema`."""
        component = trainer_state.get("component", "transformer")
        return {component: f"{component}_ema", "lora": "lora_ema", f"merged/{component}": f"merged/{component}_ema"}

    cfg: DiTJobConfig
    family: DiTFamily
    mesh: Mesh  # (the contract's MeshLike: the engines take the mesh itself)

    def __init__(self, cfg: DiTJobConfig, family: DiTFamily, mesh: Mesh, device: torch.device, precision: str) -> None:
        if not isinstance(family, DiTFamily):
            raise TypeError(f"the flow-matching task trains DiT families; {family.name} is a {family.kind} family")
        super().__init__(cfg, family, mesh, device, precision)
        self.seed = cfg.train.seed
        self.component = trained_component(cfg, family)  # the checkpoint folder trained and exported
        self.condition = self._build_condition()
        self.objective: Objective = build_objective(cfg.train.objective, cfg)  # what the step optimises (objectives/)

    # ------------------------------------------------------------ checks before launch

    @classmethod
    def check_plan(cls, cfg: DiTJobConfig, family: DiTFamily, dims: ParallelDimsLike) -> None:
        from spindle.distributed.context_parallel import check_family_sequence_parallel

        build_objective(cfg.train.objective, cfg).check_plan(family, dims)  # what the objective refuses, first
        check_audio(cfg, family)
        check_family_sequence_parallel(family, cfg.model.path, dims.sp, dims.ring)
        check_validation_images(cfg, family)
        from spindle.distributed.mesh import device_type
        from spindle.ops.dit_attention import check_dit_backend

        try:
            check_dit_backend(cfg.model.attention_backend, device_type(), ulysses=dims.sp, ring=dims.ring)
        except ValueError as e:
            raise ConfigError(f"model.attention_backend: {e}") from None
        # every bucket must split over the SP ranks: said before launch (pairs: when their loader is built)
        if cfg.data.buckets and dims.cp_size > 1 and cfg.train.objective == "flow_matching":
            dit_data(cfg, family, check=False, warn_skipped=False)
        elif dims.cp_size > 1 and cfg.train.objective == "flow_matching":
            check_fixed_shape_split(cfg, family, dims.cp_size)
        index = read_model_index(cfg.model.path, missing_ok=True)
        if index and family.inference is not None:
            # checkpoint variants the family cannot serve are not trained either (they would train with
            # exit 0 and export what nothing can load)
            family.inference_spec().check_checkpoint(index)
        trained_component(cfg, family)  # a two-expert checkpoint trains the expert train.expert names

    # ------------------------------------------------------------ set-up

    def _build_condition(self) -> ConditionModel:
        # with a precomputed cache only the training-input side loads (no text encoder / VAE weights)
        encoders = self.cfg.data.precomputed is None
        cond = build_condition_model(self.cfg, self.family, self.device, self.precision, encoders=encoders)
        cond.timestep_sampling = self.cfg.train.timestep
        if self.cfg.train.expert is not None:
            cond.select_expert(self.cfg.train.expert)  # timesteps within that expert's range only
        return cond

    def build_model(self) -> torch.nn.Module:
        model = self._build_model()
        self.objective.prepare(self, model)  # what the objective holds beside it (a frozen reference)
        return model

    def build_reference(self) -> torch.nn.Module:
        """Collective: a frozen copy of the starting transformer, loaded and sharded as the trained one is (no
        LoRA, no gradient, no optimizer state), in eval mode: a full fine-tune's reference of a preference or RL
        objective (a LoRA run's is the policy with its adapters off, `spindle.train.lora.adapters_disabled`)."""
        import copy

        twin = copy.copy(self)  # the same condition model and mesh; only the build settings differ
        twin.cfg = self.cfg.model_copy(
            update={"train": self.cfg.train.model_copy(update={"lora": None, "gradient_checkpointing": False})}
        )
        model = twin._build_model()
        model.requires_grad_(False)
        model.eval()
        return model

    def _build_model(self) -> torch.nn.Module:
        from spindle.distributed.sharded_load import SafetensorsCheckpoint
        from spindle.ops.dit_attention import apply_dit_backend
        from spindle.train.lora import init_adapters, is_lora_name

        root, component = self.cfg.model.path, self.component
        lora = self.cfg.train.lora
        config = json.loads((Path(root) / component / "config.json").read_text())
        model = build_parallel_model(
            self,
            # the family's context-parallel plan where it has its own (LTX-2 splits its audio stream too)
            ParallelPlan("diffusers", cp_plan=self.family.inference_spec().sequence_parallel_plan(config)),
            build_empty=lambda: transformer_from_config(root, component),
            checkpoint=lambda: SafetensorsCheckpoint(Path(root) / component).sources(),
            load_full=lambda: load_transformer(root, dtype=torch.float32, component=component),
            convert=None if lora is None else self.add_adapters,  # converters before SP / FSDP2
            fresh=is_lora_name,
            init_fresh=None if lora is None else lambda model: init_adapters(model, self.seed),
            weights=Path(root) / component,
        )
        apply_dit_backend(model, self.cfg.model.attention_backend)  # native: nothing set (the stock attention)
        return model

    def add_adapters(self, model: torch.nn.Module) -> None:
        """LoRA adapters before SP / checkpointing / FSDP2 (the frozen base is then stored as
        `train.frozen_dtype` says, by build_parallel_model; on meta too: sharded loading reads into
        each parameter's dtype)."""
        lora = self.cfg.train.lora
        if lora is not None:
            add_lora(model, lora)

    @classmethod
    def check_data(cls, cfg: DiTJobConfig, family: DiTFamily | None = None) -> None:
        own = getattr(build_objective(cfg.train.objective, cfg), "check_data", None)
        if own is not None:  # an objective with its own data format (preference pairs) checks it
            own()
        elif cfg.data.precomputed is None:  # every file decoded once (cached): one report before the model loads
            # (with data.audio each clip's soundtrack too, in the format the family's checkpoint takes)
            dit_data(cfg, None, audio=audio_track(cfg, family))

    def data_stats(self) -> dict[str, Any]:
        return dict(getattr(self, "_data_stats", {}))

    def step_metrics(self) -> dict[str, Any]:
        """data.sources: how many samples of the step's global batch came from each source; and the objective's
        own step values (Flow-GRPO's log-prob mismatch over every rank, its reward metrics)."""
        metrics: dict[str, Any] = self.objective.step_metrics(self)
        mix = getattr(self, "_mix", None)
        if mix is not None:
            metrics.update({f"source/{name}": n for name, n in mix.counts(self._loader.current_global_batch()).items()})
        return metrics

    def build_loader(self) -> BatchLoader:
        return self.objective.build_loader(self)

    def media_loader(self) -> ResumableLoader:
        """This rank's micro-batches of the job's media samples (buckets, sources, captions), or of their
        precomputed conditions (`data.precomputed`)."""
        from spindle.data.datasets import collate
        from spindle.data.precomputed import CachedConditions, cache_settings, collate_conditions

        data = self.cfg.data
        # with precomputed conditions the media is never decoded, so it is not checked either; the
        # skipped files were named by check_data, before the model was built
        built = dit_data(self.cfg, self.family, check=data.precomputed is None, warn_skipped=False)
        media = built.dataset
        self._data_stats = built.stats
        self._mix = built.mix
        source: Any = media
        if data.precomputed is not None:  # the same samples, read as cached conditions
            settings = cache_settings(
                self.cfg,
                self.family.name,
                condition_dtype(self.precision),
                self.family.condition_model_cls().encoding_version,
            )
            source = CachedConditions(data.precomputed, settings, media.samples, media.captions)
        collate_fn = collate if data.precomputed is None else collate_conditions
        self._loader = resumable_loader(self, source, collate_fn, order=built.order)
        return self._loader

    # ------------------------------------------------------------ step

    def begin_step(self, model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        return self.objective.begin_step(self, model, batches, step)

    def updates_per_batch(self) -> int:
        return self.objective.updates_per_batch()

    def loss_units(self, batch: dict[str, Any]) -> int:
        return self.objective.loss_units(batch)

    def forward(self, model: torch.nn.Module, batch: dict[str, Any], step: int) -> StepOutput:
        return self.objective.forward(self, model, batch, step)

    def training_inputs(self, model: torch.nn.Module, batch: dict[str, Any], step: int) -> TrainingInputs:
        """A micro-batch's transformer inputs and flow-matching target: its conditions (encoded now, or read
        from a precomputed cache), noise and sigmas from per-sample generators keyed on (seed, step, sample), so
        every layout and every resume sees the same values; the sequence split checked under SP."""
        if "conditions" in batch:  # read from a precomputed cache
            conditions = {k: v.to(self.device) for k, v in batch["conditions"].items()}
        else:
            conditions = self.condition.encode(batch)
        generators = [sample_generator(self.seed, step, int(i)) for i in batch["index"]]
        inputs = self.condition.training_inputs(conditions, generators)
        target = inputs.pop("target").to(self.device)
        sigmas = inputs.pop("sigmas")
        # elements the loss leaves out (Wan2.2 TI2V's image-to-video: the first latent frame is the clean image)
        loss_mask = inputs.pop("loss_mask", None)
        extra = {i: t.to(self.device) for i, t in inputs.pop("extra_targets", {}).items()}
        inputs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        tokens_per_sample = self.condition.tokens_per_sample(inputs)
        if tokens_per_sample is None:
            patch = getattr(getattr(model, "config", None), "patch_size", 1)
            tokens_per_sample = count_tokens(inputs["hidden_states"], patch)
        self._check_sequence_split(model, tokens_per_sample, inputs)
        return TrainingInputs(inputs, target, sigmas, loss_mask, len(generators), tokens_per_sample, extra)

    @staticmethod
    def _check_sequence_split(model: torch.nn.Module, tokens: int, inputs: dict[str, Any]) -> None:
        """SP (Ulysses x ring) splits sequences evenly; say so clearly instead of failing inside diffusers."""
        from spindle.distributed.context_parallel import (
            check_sequence_parallel,
            check_split_inputs,
            sequence_parallel_degrees,
        )

        sp, ring = sequence_parallel_degrees(model)
        if sp * ring > 1:
            check_sequence_parallel(model, sp, seq_len=tokens, ring=ring)
            check_split_inputs(model, sp * ring, inputs)

    def validate(self, model: torch.nn.Module, step: int, out_dir: Path) -> list[Any]:
        from spindle.train.validation import render_samples

        return render_samples(self, model, step, out_dir)

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        lora = self.cfg.train.lora
        return {
            "family": self.family.name,
            "lora": lora.model_dump() if lora is not None else None,
            "max_text_length": self.cfg.model.max_text_length,  # recorded in exports (spindle.export.record)
            "component": self.component,  # the transformer folder trained (a two-expert checkpoint's expert)
            "sample_size": self.sample_size(),  # the LoRA card's commands generate at it
        }

    def sample_size(self) -> dict[str, int]:
        height, width = self.cfg.data.resolution
        return {"height": height, "width": width, "num_frames": self.cfg.data.num_frames}

    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        root, component = self.cfg.model.path, self.component
        dtypes = export_dtypes(self.cfg.export.dtype, Path(root) / component)
        if self.cfg.train.lora is None:
            trained = {"family": self.family.name, "max_text_length": self.cfg.model.max_text_length}
            return export_pipeline_sharded(root, model, out, trained, dtypes, component)
        from spindle.train.lora import adapter_state_dict, lora_scale

        sd = ckpt.full_state_dict(model, trainable_only=True)  # collective: the adapters only
        result = None
        if is_main_process():
            adapters = adapter_state_dict(sd, lora_scale(model))
            result = export_lora(
                self.family,
                self.cfg.model.path,
                adapters,
                out,
                self.cfg.export.merge_lora,
                max_text_length=self.cfg.model.max_text_length,
                dtypes=dtypes,
                component=component,
                size=self.sample_size(),
            )
        barrier()
        return result

    @classmethod
    def export_checkpoint(
        cls,
        family: DiTFamily,
        checkpoint: Path,
        model_path: Path,
        out: Path,
        dtype: str = "auto",
        merge: bool = False,
    ) -> Path:
        """One process, without building the model: the trained tensors are streamed from the checkpoint
        (`spindle.export.diffusers.export_pipeline_streamed`), a LoRA run's adapters read by name."""
        from spindle.model_index import MODEL_INDEX, has_model_index
        from spindle.train.lora import checkpoint_adapters

        if not has_model_index(model_path):
            raise FileNotFoundError(f"base model {model_path} has no {MODEL_INDEX}; pass --model PATH")
        state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
        component = state.get("component", "transformer")  # absent: a checkpoint from before it was recorded
        dtypes = export_dtypes(dtype, model_path / component)
        text_length = state.get("max_text_length")  # None: a checkpoint from before it was recorded
        trained = {"family": family.name, "max_text_length": text_length}
        if state.get("lora") is None:
            return export_pipeline_streamed(checkpoint, model_path, out, trained, dtypes, component)
        adapters = checkpoint_adapters(checkpoint, state["lora"])
        return export_lora(
            family,
            model_path,
            adapters,
            out,
            merge=merge,
            max_text_length=text_length,
            dtypes=dtypes,
            component=component,
            size=state.get("sample_size"),  # None: a checkpoint from before it was recorded
        )


def check_validation_images(cfg: DiTJobConfig, family: DiTFamily) -> None:
    """`train.validation.images`: for a family that takes conditioning images, one entry per prompt (a path,
    or a list of paths for a request of several images) holding as many existing files as a request to
    this checkpoint takes; none for one that does not (checked before launch, not at the first validation step)."""
    val = cfg.train.validation
    least, most = family.options.images  # (an optional image: Wan2.2 TI2V)
    if not val.every_steps or not val.prompts:
        return
    if not most and val.images:
        raise ValueError(f"train.validation.images: {family.name} generates from text alone; remove the images")
    if (least or val.images) and len(val.images) != len(val.prompts):
        raise ValueError(
            f"train.validation.images: {family.name} needs a conditioning image per validation prompt; got "
            f"{len(val.images)} image(s) for {len(val.prompts)} prompt(s)"
        )
    from spindle.contracts.images import request_images
    from spindle.contracts.request import RequestError

    # what a request to this checkpoint takes (a first-last-frame checkpoint: [first, last]), by the requests' rule
    bounds = family.condition_model_cls().request_images(cfg.model.path) or (least, most)
    for index, entry in enumerate(val.images):
        try:
            request_images(entry, None, bounds, family.name, names=(f"train.validation.images[{index}]", ""))
        except RequestError as e:
            raise ValueError(f"{e} (a request to {cfg.model.path})") from None
    if val.options:  # the family's sampling options: names, types, bounds (sizes are checked per request)
        from spindle.contracts.request import SamplingParams
        from spindle.contracts.sampling import sampling_schema

        try:
            sampling_schema(family.options, family.name).validate(
                SamplingParams(prompt=val.prompts[0], extra=dict(val.options))
            )
        except RequestError as e:
            raise ValueError(f"train.validation.options: {e}") from None


def dit_data(
    cfg: Any,
    family: DiTFamily | None,
    check: bool = True,
    warn_skipped: bool = True,
    captions: bool = True,
    audio: AudioTrack | None = None,
) -> Any:
    """The job's dataset, order and report (`spindle.data.dit_data`), buckets on the family's pixel grid;
    without a family only the samples are listed and checked (before the model is built; `audio`: with the
    soundtracks `data.audio` reads). `captions=False`: the first caption of each sample, never dropped (what
    `spindle precompute` caches)."""
    from spindle.data.dit_data import build_dit_data

    grid = None if family is None else lambda: family.condition_model_cls().pixel_grid(cfg.model.path)
    if family is not None:
        audio = audio_track(cfg, family)
    split = cfg.parallel.sp * cfg.parallel.ring
    return build_dit_data(
        cfg.data, grid, cfg.train.seed, cfg.train.global_batch_size, check, warn_skipped, captions, split, audio
    )


def audio_track(cfg: Any, family: DiTFamily | None) -> AudioTrack | None:
    """The soundtrack format `data.audio` reads each clip's sound in (the family's checkpoint says); None
    without data.audio."""
    if not getattr(cfg.data, "audio", False) or family is None:
        return None
    return family.condition_model_cls().audio_track(cfg.model.path)


def check_audio(cfg: Any, family: DiTFamily) -> None:
    """`data.audio`, before launch: a family with an audio stream (the checkpoint's format read), the plain
    flow-matching objective (the preference and RL objectives score the video alone) and no frame buckets (each
    clip must last data.num_frames at the family's frame rate, the sound in sync with the frames)."""
    if not cfg.data.audio:
        return
    try:
        audio_track(cfg, family)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.train.objective != "flow_matching":
        raise ConfigError(
            f"data.audio trains with train.objective: flow_matching; {cfg.train.objective} scores the video "
            "alone: remove data.audio"
        )
    if cfg.data.buckets:
        raise ConfigError(
            "data.audio takes clips of exactly data.num_frames (the sound in sync with the frames); data.buckets "
            "would train clips at other frame counts: remove data.buckets"
        )


def check_fixed_shape_split(cfg: Any, family: DiTFamily, degree: int) -> None:
    """Without buckets every sample trains at data.resolution x data.num_frames: its latent token count must
    divide over the SP x ring ranks, said before launch (the text tokens some transformers join are checked
    when the first batch is built)."""
    from spindle.data.buckets import shape_tokens

    data = cfg.data
    shape = (int(data.num_frames), int(data.resolution[0]), int(data.resolution[1]))
    grid = family.condition_model_cls().pixel_grid(cfg.model.path)
    tokens = shape_tokens(shape, grid)
    if tokens % degree:
        frames = "" if grid.frame_multiple is None else f" x {shape[0]} frames"
        raise ConfigError(
            f"data.resolution={list(data.resolution)}{frames} makes {tokens} tokens, which is not divisible by "
            f"parallel.sp x parallel.ring = {degree}: each sequence-parallel rank holds an equal slice of every "
            f"sample; choose a resolution (multiples of {grid.height}x{grid.width} pixels per token) or frame count "
            f"whose token count divides by {degree}"
        )


def condition_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def build_condition_model(
    cfg: Any, family: Any, device: torch.device, precision: str, encoders: bool = True
) -> ConditionModel:
    """The family's frozen condition model for a job config (training and `spindle precompute`)."""
    model: ConditionModel = family.condition_model_cls().from_pretrained(
        cfg.model.path,
        device=device,
        dtype=condition_dtype(precision),
        max_text_length=cfg.model.max_text_length,
        encoders=encoders,
    )
    return model


def add_lora(model: torch.nn.Module, lora: Any) -> torch.nn.Module:
    from spindle.distributed.blocks import find_blocks
    from spindle.train.lora import apply_lora

    return apply_lora(model, find_blocks(model), lora)
