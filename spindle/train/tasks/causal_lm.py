"""The causal-LM task: a transformers ForCausalLM trained on next-token loss from text/chat JSONL.

- Model: the family's ForCausalLM class (`CausalLMFamily.model_class`: stock transformers, or the
  family's patchgen-generated class with the chunked loss), built on meta, parallelized by the one path
  (spindle.distributed.parallelize: Ulysses SP, transformers' non-reentrant activation checkpointing,
  compile, FSDP2 per decoder layer then root, HSDP with dp_replicate), then each rank reads its shards
  in fp32 (spindle.distributed.sharded_load; `model.sharded_load: false` loads the whole model first).
- Data: `spindle.data.text` rows (packed documents, per-document positions, pre-shifted labels).
- Loss: the model's own loss path asked for a *sum* over valid tokens (see `LOSS_SUM`); the trainer
  divides by the valid-token count of the global batch (`loss_units`), so the step loss is the mean
  over every valid token of the global batch, whatever the micro-batch / data-parallel / SP split.
- Export: a transformers folder (config, generation config, tokenizer, sharded safetensors) written
  shard by shard with DCP's Hugging Face writer (spindle.export.transformers); stock
  `AutoModelForCausalLM.from_pretrained` loads it.
- Parts: a MoE family's experts (`spindle.train.parts.experts.Experts`, chosen from the family record: its
  checkpoint adapter) are a part the task holds and calls at named points (load, plan, step, metrics, export),
  whatever the task's input kind (text here; vision and omni in vlm.py / omni.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from spindle.config import CausalLMJobConfig, ConfigError
from spindle.contracts.family import CausalLMFamily
from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.protocols import BatchLoader, ParallelDimsLike
from spindle.contracts.task import Objective, StepOutput, TrainTask
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.mesh import barrier, is_main_process
from spindle.export.dtypes import ExportDtypes, check_export_dtype
from spindle.export.transformers import ExportSource, load_tokenizer, write_transformers_folder
from spindle.train.objectives import build_objective
from spindle.train.packing import has_linear_attention, packs, read_config
from spindle.train.parts.experts import PADDING_MASK_KEY, Experts
from spindle.train.tasks.base import build_parallel_model, resumable_loader

if TYPE_CHECKING:
    from spindle.data.loader import ResumableLoader
    from spindle.distributed.mesh import Mesh
    from spindle.distributed.sharded_load import TensorSource

log = logging.getLogger("spindle.train")

# Keyword arguments that make a ForCausalLM forward return the plain *sum* of the token losses of
# `shift_labels` (already shifted, -100 ignored). Both paths honour them: stock transformers'
# `ForCausalLMLoss` uses `shift_labels` when given (it needs `labels` non-None to compute a loss at
# all) and divides a sum by `num_items_in_batch`; the patched forwards' `causal_lm_loss` does the same
# from hidden states. Dividing by 1 is exact, so the two paths agree bit for bit on the reduction.
LOSS_SUM = {"num_items_in_batch": 1}
TOKEN_KEYS = ("input_ids", "position_ids", "shift_labels")


def causal_lm_output(model: torch.nn.Module, batch: dict[str, torch.Tensor], **model_kwargs: Any) -> Any:
    """The forward output of a batch of rows (input_ids, position_ids, shift_labels); `.loss` is the sum.

    -> the model's transformers `ModelOutput` (Any: mypy does not follow transformers)."""
    labels = batch["shift_labels"]
    return model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        labels=labels,
        shift_labels=labels,
        use_cache=False,  # no cache: transformers then reads document boundaries from position_ids
        **LOSS_SUM,
        **model_kwargs,
    )


def is_spindle_patched(model: torch.nn.Module) -> bool:
    """The model's class is a patchgen-generated one (`spindle/models/*/generated/`), whose forward takes
    Spindle's loss arguments (`loss_reduction`, chunked from hidden states); FSDP2 subclasses it."""
    return any(".generated.patched_modeling_" in c.__module__ for c in type(model).__mro__)


def causal_lm_log_probs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, **model_kwargs: Any
) -> tuple[Any, torch.Tensor]:
    """(the forward output, each position's log-probability of its `shift_labels` token [rows, seq], 0 where
    -100): what sequence objectives (DPO, GRPO) sum or weigh, of the logits divided by `temperature` (GRPO scores
    completions as they were sampled). A patched model computes them from its hidden states chunk by chunk
    (`loss_reduction="none"`, no [tokens, vocab] logits) at temperature 1; otherwise from its logits."""
    from spindle.train.objectives.logprobs import token_log_probs_from_logits

    labels = batch["shift_labels"]
    common = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    if is_spindle_patched(model) and temperature == 1.0:
        out = model(labels=labels, shift_labels=labels, loss_reduction="none", **common, **model_kwargs)
        return out, -out.loss
    out = model(**common, **model_kwargs)
    return out, token_log_probs_from_logits(out.logits, labels, temperature)


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token loss of a batch of rows (input_ids, position_ids, shift_labels)."""
    loss: torch.Tensor = causal_lm_output(model, batch).loss
    return loss


# What AutoTokenizer can build a tokenizer from: a fast tokenizer file, a sentencepiece model, or a BPE pair.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_tokenizer_files(path: str | Path) -> None:
    """Before any work: the model folder carries its tokenizer. Without it, transformers fails late and
    obliquely (a missing sentencepiece, or every label masked); say which folder lacks what."""
    folder = Path(path)
    if not any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILES):
        wanted = " or ".join(" + ".join(names) for names in TOKENIZER_FILES)
        raise ConfigError(
            f"{folder} has no tokenizer ({wanted}): copy the tokenizer files of the base model into it "
            "(tokenizer.json, tokenizer_config.json and the rest of its tokenizer files)"
        )


@dataclass
class RowsRun:
    """A micro-batch's rows run through the model on this rank (`CausalLMTask.run_rows`)."""

    out: Any  # the model's transformers ModelOutput (`.loss`: the summed token loss)
    rows: dict[str, torch.Tensor]  # this rank's rows as the model got them (after the SP split)
    samples: int  # rows in the micro-batch
    tokens: int  # tokens of the whole rows
    log_probs: torch.Tensor | None = None  # [rows, seq] with `log_probs=True`: each label token's log-probability


@dataclass
class PreferenceInputs:
    """How a task's input kind reads the post-training objectives' data (`CausalLMTask.preference_inputs`):
    preference pairs (DPO), prompts and the rows of their completions (GRPO)."""

    tokenize: Callable[..., Any] | None  # a `spindle.data.preference.PairTokenizer`; None: the text tokenizer's
    media_ids: frozenset[int]  # media placeholder tokens, which prompt truncation must not cut
    collate: Callable[..., dict[str, torch.Tensor]]  # (pairs, pad_id=, multiple=) -> a batch of 2B rows
    # ((prompt ids, completion ids, media) rows, pad_id=, multiple=) -> a batch of those rows
    collate_rows: Callable[..., dict[str, torch.Tensor]]
    tokenize_prompt: Callable[..., Any] | None = None  # a `PromptTokenizer`; None: the text tokenizer's
    # (a prompt example, rows) -> `sample_group`'s step_inputs for that many completions of it; None: text
    rollout_inputs: Callable[..., Any] | None = None


class CausalLMTask(TrainTask[CausalLMJobConfig, CausalLMFamily]):
    name = "causal_lm"
    config_class = CausalLMJobConfig
    # With Ulysses SP each rank holds a chunk of the sequence and computes that chunk's loss only.
    loss_sharded_over_sp = True

    cfg: CausalLMJobConfig
    family: CausalLMFamily
    mesh: Mesh  # (the contract's MeshLike: the engines take the mesh itself)
    # Files copied from the input folder into an export besides config, weights and tokenizer.
    export_files: tuple[str, ...] = ()

    def __init__(
        self, cfg: CausalLMJobConfig, family: CausalLMFamily, mesh: Mesh, device: torch.device, precision: str
    ) -> None:
        if not isinstance(family, CausalLMFamily):
            raise ConfigError(
                f"model {cfg.model.path} is a {family.name} {family.kind} model, not a causal language model"
            )
        super().__init__(cfg, family, mesh, device, precision)
        self.tokenizer = load_tokenizer(cfg.model.path)
        # {adapter module: parameter} of LoRA on fused expert parameters (`prepare_model`), for the export
        self.lora_parameters: dict[str, str] = {}
        self.experts = Experts.of(family)  # a MoE family's experts part; None for a dense model
        self.objective: Objective = build_objective(cfg.train.objective, cfg)  # what the step optimises (objectives/)
        # the model-class choice: an objective that trains another head than the LM head names it (`reward`: a
        # ForSequenceClassification with a fresh score head, objectives/reward.py ScoreHead); None: the ForCausalLM
        self.head: Any = getattr(self.objective, "head", lambda: None)()

    @classmethod
    def supports_expert_parallel(cls, family: Any) -> bool:
        return Experts.of(family) is not None

    # ------------------------------------------------------------ checks before launch

    @classmethod
    def check_plan(cls, cfg: CausalLMJobConfig, family: CausalLMFamily, dims: ParallelDimsLike) -> None:
        check_tokenizer_files(cfg.model.path)
        # DiT-only training options must not be silently ignored on a language model.
        if cfg.train.validation.every_steps and cfg.train.validation.prompts:
            raise ConfigError(
                "train.validation renders image/video samples (DiT families); for a language model set "
                "train.validation.every_steps: 0"
            )
        if dims.ring > 1:
            raise ConfigError(
                f"parallel.ring={dims.ring}: ring attention is for DiTs; language models split sequences with "
                "Ulysses only (parallel.sp); set parallel.ring: 1"
            )
        # transformers' torch path of Gated DeltaNet takes no document boundaries (its chunked recurrence and
        # causal convolution ignore cu_seqlens): a packed row would carry state from one document into the next
        if cfg.data.packing and has_linear_attention(read_config(cfg.model.path)):
            raise ConfigError(
                f"data.packing: {family.name} models have linear-attention (Gated DeltaNet) layers, whose "
                "recurrent state would flow from one packed document into the next; set data.packing: false "
                "(one document per row; the default for these models)"
            )
        if cfg.data.packing and family.packing_refused:
            raise ConfigError(
                f"data.packing: {family.name} models: {family.packing_refused}; set data.packing: false (one document "
                "per row; the default for these models)"
            )
        if dims.sp > 1 and family.sequence_parallel_refused:
            raise ConfigError(f"parallel.sp={dims.sp}: {family.sequence_parallel_refused}; set parallel.sp: 1")
        if dims.sp > 1:
            from spindle.distributed import ulysses_attention

            config = read_config(cfg.model.path)
            try:
                ulysses_attention.check_layout(cls.text_config(config), dims.sp, cfg.data.seq_len)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if (experts := Experts.of(family)) is not None:
            experts.check_plan(cfg.model.path, dims)
        build_objective(cfg.train.objective, cfg).check_plan(family, dims)
        cls.attention(cfg, cfg.train.mixed_precision, family)

    @classmethod
    def packs(cls, cfg: CausalLMJobConfig, family: CausalLMFamily | None = None) -> bool:
        """`data.packing` resolved: as set, else true unless the model's layers cannot keep packed documents
        apart (linear attention) or the `family` refuses packing (`CausalLMFamily.packing_refused`)."""
        return packs(cfg.data.packing, cfg.model.path, family)

    @classmethod
    def attention(cls, cfg: CausalLMJobConfig, precision: str, family: CausalLMFamily) -> str:
        """The language model's transformers attn_implementation for `model.attn_implementation` (auto
        resolved); ConfigError saying why when it cannot run (spindle.ops.attention_backend)."""
        from spindle.distributed.mesh import device_type
        from spindle.ops.attention_backend import resolve_attention
        from spindle.ops.varlen_attention import implementation_name

        text = cls.text_config(json.loads((Path(cfg.model.path) / "config.json").read_text()))
        try:
            setting = resolve_attention(
                cfg.model.attn_implementation,
                device_type=device_type(),
                precision=precision,
                text_config=text,
                model_class=family.model_cls(),
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return implementation_name(setting)

    def activation_memory(self) -> Any:
        """The decoder's saved activations for one micro-batch of `data.seq_len` rows on this rank
        (spindle.train.memory.activation_memory): the start-of-run summary prints it."""
        from spindle.train.memory import activation_memory

        text = self.text_config(json.loads((Path(self.cfg.model.path) / "config.json").read_text()))
        return activation_memory(
            text,
            rows=self.cfg.train.micro_batch_size,
            seq_len=self.cfg.data.seq_len,
            sp=self.mesh.dims.sp,
            bytes_per_value=2 if self.precision == "bf16" else 4,
            checkpointing=self.cfg.train.gradient_checkpointing,
            dense_mask=self.packs(self.cfg, self.family)
            and self.attention(self.cfg, self.precision, self.family) in ("sdpa", "eager"),
        )

    @classmethod
    def text_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The language model's part of a config.json (what Ulysses SP splits the heads of)."""
        return config

    # ------------------------------------------------------------ set-up

    def load_model(self) -> Any:
        """The family's ForCausalLM from the transformers folder, fp32 (master weights), sdpa attention."""
        if self.experts is not None:  # every expert loaded from the checkpoint's layout, or an error
            return self.experts.load_full(
                self.cfg.model.path, self.device.type, attn_implementation=self.load_attention()
            )
        if self.head is not None:  # the decoder from the checkpoint, the head as `init_fresh` sets it (both paths)
            config = self.model_config()
            return self.head.model_cls(config).from_pretrained(
                self.cfg.model.path, config=config, dtype=torch.float32, attn_implementation=self.load_attention()
            )
        cls: Any = self.family.model_cls()
        return cls.from_pretrained(
            self.cfg.model.path,
            dtype=torch.float32,
            attn_implementation=self.load_attention(),
            **self.model_init_kwargs(),
        )

    def load_attention(self) -> str:
        """The attention the model is built with, before the run's own is installed (`parallel_plan`): sdpa,
        or eager for a class transformers refuses sdpa for (GPT-OSS: its attention sinks)."""
        from spindle.ops.attention_backend import supports_sdpa

        return "sdpa" if supports_sdpa(self.family.model_cls()) else "eager"

    def model_config(self) -> Any:
        """The transformers config of the model the task trains (config.json; a sub-model's part of it where
        the family trains one, e.g. an omni model's thinker)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.cfg.model.path)
        return config if self.head is None else self.head.config(config, self.pad_token_id())

    def pad_token_id(self) -> int:
        """The id right-padded batches are padded with: the tokenizer's pad token, else its EOS."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def model_init_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments of the model's construction (both load paths): a MoE's experts kernel."""
        return {} if self.experts is None else self.experts.init_kwargs(self.cfg.model.path, self.device.type)

    def empty_model(self) -> torch.nn.Module:
        """The family's ForCausalLM built from config.json alone, as `load_model` would build it (fp32, sdpa,
        tied embeddings, the folder's generation config), its parameters on the meta device."""
        from transformers import GenerationConfig

        from spindle.distributed.sharded_load import empty_weights

        path = Path(self.cfg.model.path)
        config = self.model_config()
        cls: Any = self.family.model_cls() if self.head is None else self.head.model_cls(config)
        with empty_weights():
            model = cls._from_config(
                config,
                dtype=torch.float32,
                attn_implementation=self.load_attention(),
                **self.model_init_kwargs(),
            )
        # outside empty_weights, whose parameter registration makes a new tensor: tying must keep one
        model.tie_weights()  # `from_pretrained` ties after loading (config.tie_word_embeddings); `_from_config` not
        if (path / "generation_config.json").is_file() and self.head is None:  # a scoring head generates nothing
            model.generation_config = GenerationConfig.from_pretrained(path)
        built: torch.nn.Module = model
        return built

    def checkpoint_sources(self) -> dict[str, TensorSource]:
        """The checkpoint's tensors as the model holds them: under the model's names (`named_sources`), a
        MoE's per-expert tensors read as the fused ones."""
        sources = self.named_sources()
        if self.head is not None:
            sources = self.head.sources(sources)
        return sources if self.experts is None else self.experts.checkpoint_sources(sources)

    def named_sources(self) -> dict[str, TensorSource]:
        """The checkpoint's tensors under the model's names (a text model's: the checkpoint's own)."""
        from spindle.distributed.sharded_load import SafetensorsCheckpoint

        return SafetensorsCheckpoint(self.cfg.model.path).sources()

    def parallel_plan(self) -> ParallelPlan:
        # the language model's attention (model.attn_implementation) on the plan of the task's input kind
        plan = dataclasses.replace(self.input_plan(), attention=self.attention(self.cfg, self.precision, self.family))
        return plan if self.experts is None else self.experts.plan(plan)

    def input_plan(self) -> ParallelPlan:
        """The plan of the task's input kind (a VLM's: SP in its language model only)."""
        return ParallelPlan("transformers")

    def build_model(self) -> torch.nn.Module:
        from contextlib import nullcontext

        with nullcontext() if self.experts is None else self.experts.building(self.cfg.model.path):
            model = self._build_model()
        self.objective.prepare(self, model)
        return model

    def build_reference(self, path: str | Path) -> tuple[CausalLMTask, torch.nn.Module]:
        """Collective: a frozen copy of the family's model from `path` (the starting policy, or another folder of
        the same family), loaded and sharded as the trained model is (no LoRA, no gradient, no optimizer state),
        in eval mode: the reference of a preference or RL objective. -> (the task that runs it: its `run_rows`
        feeds the copy's own input hooks, the copy)."""
        from contextlib import nullcontext

        cfg = self.cfg.model_copy(
            update={
                "model": self.cfg.model.model_copy(update={"path": str(path)}),
                "train": self.cfg.train.model_copy(
                    update={"lora": None, "objective": "sft", "gradient_checkpointing": False, "freeze": []}
                    if hasattr(self.cfg.train, "freeze")
                    else {"lora": None, "objective": "sft", "gradient_checkpointing": False}
                ),
            }
        )
        twin = type(self)(cfg, self.family, self.mesh, self.device, self.precision)
        with nullcontext() if twin.experts is None else twin.experts.building(path):
            model = twin._build_model()
        model.requires_grad_(False)
        model.eval()
        return twin, model

    def _build_model(self) -> torch.nn.Module:
        from spindle.train.lora import init_adapters, is_lora_name

        lora, head = self.cfg.train.lora, self.head
        fresh, init_fresh = None, None
        if lora is not None and head is not None:  # adapters and the new head, both keyed on train.seed
            fresh = lambda name: is_lora_name(name) or head.is_fresh(name)  # noqa: E731

            def init_fresh(model: torch.nn.Module) -> None:
                init_adapters(model, self.cfg.train.seed)
                head.init(model)

        elif lora is not None:
            fresh, init_fresh = is_lora_name, lambda model: init_adapters(model, self.cfg.train.seed)
        elif head is not None:  # the new head (a reward model's score), keyed on train.seed
            fresh, init_fresh = head.is_fresh, head.init
        return build_parallel_model(
            self,
            self.parallel_plan(),
            build_empty=self.empty_model,
            checkpoint=self.checkpoint_sources,
            load_full=self.load_model,
            convert=self.prepare_model,
            fresh=fresh,
            init_fresh=init_fresh,
            weights=Path(self.cfg.model.path),
        )

    def prepare_model(self, model: torch.nn.Module) -> None:
        """What changes the model before it is parallelized, on either load path (its parameters may be
        on meta): LoRA adapters on `lora_blocks` (spindle.train.lora; their values are set after loading)."""
        if self.cfg.train.lora is not None:
            from spindle.train.lora import apply_lora, wrapped_parameters

            apply_lora(model, self.lora_blocks(model), self.cfg.train.lora)
            # recorded in the checkpoint state so that `spindle export` writes their PEFT config
            self.lora_parameters = wrapped_parameters(model)
            if self.head is not None:  # a new head trains whole beside the adapters (PEFT's modules_to_save)
                for name, param in model.named_parameters():
                    if self.head.is_fresh(name):
                        param.requires_grad_(True)

    def lora_blocks(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The blocks whose linear layers `train.lora.targets` selects from (default: all of them)."""
        from spindle.distributed.blocks import find_blocks

        return find_blocks(model)

    def build_loader(self) -> BatchLoader:
        return self.objective.build_loader(self)

    def preference_inputs(self) -> PreferenceInputs:
        """How preference pairs (DPO) are tokenised and batched for this input kind: text here."""
        from spindle.data.preference import collate_pairs, collate_rows

        return PreferenceInputs(None, frozenset(), collate_pairs, collate_rows)

    def document_loader(self) -> ResumableLoader:
        """This rank's micro-batches of the job's documents as token rows (the input kind's: text / chat JSONL
        packed into rows with per-document positions and pre-shifted labels)."""
        from spindle.data.text import build_text_dataset, collate_rows

        data = self.cfg.data
        packing = self.packs(self.cfg, self.family)
        dataset = build_text_dataset(data.path, self.tokenizer, data.seq_len, packing, data.skip_bad_samples)
        s = dataset.stats
        self._data_stats = {
            "documents": s.documents,
            "rows": s.rows,
            "label_tokens": s.label_tokens,
            "truncated": s.truncated,
            "skipped": s.skipped,
        }
        if is_main_process():
            log.info(
                "data: %d documents -> %d rows of %d tokens (%s), %d label tokens; %d truncated to seq_len, "
                "%d bad lines skipped",
                s.documents,
                s.rows,
                data.seq_len,
                "packed" if packing else "one document per row",
                s.label_tokens,
                s.truncated,
                s.skipped,
            )
            if s.truncated:
                log.warning(
                    "data: %d documents were longer than data.seq_len=%d and truncated", s.truncated, data.seq_len
                )
        # each micro-batch padded to its longest row, a multiple of the SP degree (every SP rank an equal chunk)
        return resumable_loader(self, dataset, partial(collate_rows, multiple=self.mesh.dims.sp))

    def data_stats(self) -> dict[str, Any]:
        return dict(getattr(self, "_data_stats", {}))

    # ------------------------------------------------------------ step

    def begin_step(self, model: torch.nn.Module, batches: list[Any], step: int) -> list[Any]:
        return self.objective.begin_step(self, model, batches, step)

    def updates_per_batch(self) -> int:
        return self.objective.updates_per_batch()

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return self.objective.loss_units(batch)

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepOutput:
        return self.objective.forward(self, model, batch, step)

    def run_rows(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], log_probs: bool = False, **model_kwargs: Any
    ) -> RowsRun:
        """Collective under SP / FSDP2: `batch`'s rows through the model (the input kind's way; this rank's
        chunk of them under SP), the loss asked for as a sum over valid tokens (`causal_lm_output`), or with
        `log_probs` each label token's log-probability (`causal_lm_log_probs`)."""
        rows = {k: batch[k].to(self.device) for k in (*TOKEN_KEYS, PADDING_MASK_KEY) if k in batch}
        samples, tokens = rows["input_ids"].shape[0], rows["input_ids"].numel()
        if self.mesh.dims.sp > 1:
            from spindle.distributed import ulysses_attention

            # Positions and labels were computed on the whole rows; each SP rank keeps its chunk.
            rows = ulysses_attention.shard_batch(rows, self.mesh.sp_rank, self.mesh.dims.sp)
        with self._autocast():
            if log_probs:
                out, logps = causal_lm_log_probs(model, rows, **self.model_kwargs(rows), **model_kwargs)
                return RowsRun(out, rows, samples, tokens, logps)
            out = causal_lm_output(model, rows, **self.model_kwargs(rows), **model_kwargs)
        return RowsRun(out, rows, samples, tokens)

    def scoring_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The keyword arguments besides `input_ids` of a scoring forward (a reward model's, one process) of
        `batch`'s whole right-padded rows: their attention mask (the input kind adds its own)."""
        return {"attention_mask": batch["attention_mask"].to(self.device)}

    def model_kwargs(self, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Extra keyword arguments of the training forward of this rank's `rows` (after the SP split):
        a MoE's router outputs and statistics."""
        return {} if self.experts is None else self.experts.model_kwargs(rows, self.mesh)

    def output_metrics(self, out: Any, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Values to log from a micro-batch's forward output on this rank's `rows` (StepOutput.metrics)."""
        return {} if self.experts is None else self.experts.output_metrics(out, rows, self.cfg.model.path)

    def step_metrics(self) -> dict[str, Any]:
        return {} if self.experts is None else self.experts.step_metrics(self.mesh, self.device)

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        lora = self.cfg.train.lora
        state = {"family": self.family.name, "lora": lora.model_dump() if lora is not None else None}
        if self.head is not None:  # `spindle export` of the checkpoint refuses it (its classes are the ForCausalLM's)
            state["objective"] = self.cfg.train.objective
        if self.lora_parameters:
            state["lora_parameters"] = self.lora_parameters
        if self.experts is not None:
            state.update(self.experts.state())
        return state

    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.cfg.train.lora is not None:
            from spindle.export.peft import export_lm_lora
            from spindle.train.lora import adapter_state_dict, lora_scale, wrapped_parameters

            sd = ckpt.full_state_dict(model, trainable_only=True)  # collective: the adapters (and a new head) only
            result = None
            if is_main_process():
                adapters = adapter_state_dict(sd, lora_scale(model))
                head = self.head
                result = export_lm_lora(
                    self.merge_base(self.family) if head is None else head.model_cls(model.config),
                    self.cfg.model.path,
                    adapters,
                    out,
                    merge=self.cfg.export.merge_lora,
                    rank=self.cfg.train.lora.rank,
                    extra_files=self.export_files,
                    parameters=wrapped_parameters(model),
                    head=None if head is None else head.export(model.config, sd),
                )
            barrier()
            return result

        # a model's state dict holds tensors (DTensors under FSDP2/EP), not the nested values DCP's ValueType allows
        whole = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
        if self.experts is not None:  # the experts in the input's layout, gathered one tensor at a time
            self.experts.write_folder(
                model,
                whole,
                self.cfg.model.path,
                out,
                self.cfg.export.dtype,
                rename=lambda m, s: self.export_layout(self.family, m, s),
                extra_files=self.export_files,
                finish=self.finish_export(self.family, self.cfg.model.path),
            )
            return out if is_main_process() else None
        state = self.export_layout(self.family, model, whole)
        write_transformers_folder(
            model,
            state,
            self.cfg.model.path,
            out,
            extra_files=self.export_files,
            dtype=self.cfg.export.dtype,
            finish=self.finish_export(self.family, self.cfg.model.path),
        )
        return out if is_main_process() else None

    @classmethod
    def merge_base(cls, family: CausalLMFamily) -> Any:
        """What loads the base model a LoRA is merged into (`export.merge_lora`): its `from_pretrained`."""
        experts = Experts.of(family)
        return family.model_cls() if experts is None else experts.merge_base()

    @classmethod
    def export_layout(
        cls, family: CausalLMFamily, model: torch.nn.Module, state: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The trained state dict under the names the checkpoint format uses (default: the model's own)."""
        return state

    @classmethod
    def export_checkpoint(
        cls,
        family: CausalLMFamily,
        checkpoint: Path,
        model_path: Path,
        out: Path,
        dtype: str = "auto",
        merge: bool = False,
    ) -> Path:
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_path} has no config.json; pass --model PATH")
        check_export_dtype(dtype)
        model_cls: Any = family.model_cls()
        state = json.loads((checkpoint / ckpt.TRAINER_STATE).read_text())
        if state.get("objective") == "reward":
            raise ValueError(
                f"{checkpoint} is a reward model's checkpoint: `spindle export` writes causal-LM folders; the run's "
                "own export (export/ of the run, written at its end) is the reward model's folder"
            )
        if (lora := state.get("lora")) is not None:  # the adapters alone, read by name: no model is built
            from spindle.export.peft import export_lm_lora
            from spindle.train.lora import checkpoint_adapters

            return export_lm_lora(
                model_cls,
                model_path,
                checkpoint_adapters(checkpoint, lora),
                out,
                merge=merge,
                rank=lora["rank"],
                extra_files=cls.export_files,
                parameters=state.get("lora_parameters"),
            )
        if cls.export_streamed(family, checkpoint, model_path, out, dtype):
            return out
        if Experts.of(family) is not None:  # never gather a MoE's experts into one process
            raise RuntimeError(f"{family.name}: the export names cannot be traced to the model's tensors")
        model = model_cls.from_pretrained(model_path, dtype=torch.float32)
        state = cls.export_layout(family, model, ckpt.read_checkpoint_model(checkpoint, model))
        write_transformers_folder(
            model,
            state,
            model_path,
            out,
            extra_files=cls.export_files,
            dtype=dtype,
            finish=cls.finish_export(family, model_path),
        )
        return out

    @classmethod
    def finish_export(cls, family: CausalLMFamily, source: str | Path) -> Callable[[Path, ExportDtypes], None] | None:
        """What completes an export folder written from the `family` model at `source` (None: nothing)."""
        return None

    @classmethod
    def export_sources(
        cls, family: CausalLMFamily, model: torch.nn.Module, state: dict[str, torch.Tensor], model_path: Path
    ) -> dict[str, ExportSource]:
        """{export name before `export_layout`'s renaming: (the model tensor it comes from, what turns that
        tensor's whole value into {export name: tensor} (None: the tensor as it is), its meta tensor)} for a
        meta `model`: every tensor as it is, a MoE's fused experts split or transposed (its experts part)."""
        dense: dict[str, ExportSource] = {k: (k, None, t) for k, t in state.items()}
        experts = Experts.of(family)
        return dense if experts is None else experts.export_sources(model, state, model_path, dense)

    @classmethod
    def export_streamed(cls, family: CausalLMFamily, checkpoint: Path, model_path: Path, out: Path, dtype: str) -> bool:
        """Write the export shard by shard from the checkpoint (`spindle.export.transformers.export_streamed`),
        the names traced through `export_sources` and `export_layout`. -> False when they cannot be."""
        from spindle.export.transformers import export_streamed

        return export_streamed(
            family.model_cls(),
            checkpoint,
            model_path,
            out,
            dtype,
            sources=lambda model, state: cls.export_sources(family, model, state, model_path),
            layout=lambda model, state: cls.export_layout(family, model, state),
            extra_files=cls.export_files,
            finish=cls.finish_export(family, model_path),
        )
