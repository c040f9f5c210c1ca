"""The causal-LM task: a transformers ForCausalLM trained on next-token loss from text/chat JSONL.

- Model: the family's ForCausalLM class (`CausalLMFamily.model_class`: stock transformers, or the
  family's patchgen-generated class with the chunked loss) loaded from the transformers folder in fp32;
  activation checkpointing through transformers' own (non-reentrant); FSDP2 per decoder layer then
  root (`_no_split_modules`), HSDP with dp_replicate; bf16 `MixedPrecisionPolicy` on CUDA.
- Data: `spindle.data.text` rows (packed documents, per-document positions, pre-shifted labels).
- Loss: the model's own loss path asked for a *sum* over valid tokens (see `LOSS_SUM`); the trainer
  divides by the valid-token count of the global batch (`loss_units`), so the step loss is the mean
  over every valid token of the global batch, whatever the micro-batch / data-parallel / SP split.
- Export: a transformers folder (config, generation config, tokenizer, sharded safetensors) written
  shard by shard with DCP's Hugging Face writer; stock `AutoModelForCausalLM.from_pretrained` loads it.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from spindle.config import CausalLMJobConfig, ConfigError
from spindle.contracts.family import CausalLMFamily
from spindle.contracts.task import StepOutput, TrainTask
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.mesh import barrier, is_main_process
from spindle.train.precision import check_export_dtype, export_dtypes
from spindle.train.tasks.base import resumable_loader

if TYPE_CHECKING:
    from spindle.data.loader import ResumableLoader
    from spindle.distributed.mesh import Mesh, ParallelDims

log = logging.getLogger("spindle.train")

IGNORE_INDEX = -100
# Keyword arguments that make a ForCausalLM forward return the plain *sum* of the token losses of
# `shift_labels` (already shifted, -100 ignored). Both paths honour them: stock transformers'
# `ForCausalLMLoss` uses `shift_labels` when given (it needs `labels` non-None to compute a loss at
# all) and divides a sum by `num_items_in_batch`; the patched forwards' `causal_lm_loss` does the same
# from hidden states. Dividing by 1 is exact, so the two paths agree bit for bit on the reduction.
LOSS_SUM = {"num_items_in_batch": 1}
EXPORT_MAX_SHARD_BYTES = 5 << 30  # transformers' default max_shard_size (5GB)
TOKEN_KEYS = ("input_ids", "position_ids", "shift_labels")
# Not given to attention (spindle.data.text): for task hooks that must skip padding (MoE router statistics).
PADDING_MASK_KEY = "attention_mask"


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


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed next-token loss of a batch of rows (input_ids, position_ids, shift_labels)."""
    loss: torch.Tensor = causal_lm_output(model, batch).loss
    return loss


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class CausalLMTask(TrainTask):
    name = "causal_lm"
    config_class = CausalLMJobConfig
    # With Ulysses SP each rank holds a chunk of the sequence and computes that chunk's loss only.
    loss_sharded_over_sp = True

    cfg: CausalLMJobConfig
    family: CausalLMFamily

    def __init__(
        self, cfg: CausalLMJobConfig, family: CausalLMFamily, mesh: Mesh, device: torch.device, precision: str
    ) -> None:
        if not isinstance(family, CausalLMFamily):
            raise ConfigError(
                f"model {cfg.model.path} is a {family.name} {family.kind} model, not a causal language model"
            )
        super().__init__(cfg, family, mesh, device, precision)
        self.tokenizer = load_tokenizer(cfg.model.path)

    # ------------------------------------------------------------ checks before launch

    @classmethod
    def check_plan(cls, cfg: CausalLMJobConfig, family: CausalLMFamily, dims: ParallelDims) -> None:
        # DiT-only training options must not be silently ignored on a language model.
        if cfg.train.lora is not None:
            raise ConfigError("train.lora: LoRA is implemented for DiT families only so far; remove train.lora")
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
        if dims.sp > 1:
            from spindle.distributed import ulysses_attention

            config = json.loads((Path(cfg.model.path) / "config.json").read_text())
            try:
                ulysses_attention.check_layout(config, dims.sp, cfg.data.seq_len)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    # ------------------------------------------------------------ set-up

    def load_model(self) -> Any:
        """The family's ForCausalLM from the transformers folder, fp32 (master weights), sdpa attention."""
        cls: Any = self.family.model_cls()
        return cls.from_pretrained(self.cfg.model.path, dtype=torch.float32, attn_implementation="sdpa")

    def build_model(self) -> torch.nn.Module:
        from spindle.distributed.fsdp import apply_fsdp, autocast_dtype, compile_blocks

        model = self.load_model().to(self.device)
        model.train()
        # Order (docs/architecture.md): SP -> activation checkpointing -> compile -> FSDP2.
        if self.mesh.dims.sp > 1:
            from spindle.distributed import ulysses_attention

            ulysses_attention.enable_sequence_parallel(model, self.mesh.sp)
        if self.cfg.train.gradient_checkpointing:
            # Non-reentrant: FSDP2's per-layer all-gather hooks fire again in the recomputation, and
            # parameter names stay unchanged (no wrapper module in the FQNs, checkpoints, export).
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.parallelize_extra(model)
        if self.cfg.train.compile:
            compile_blocks(model)
        # one process: nothing to shard (spindle.distributed.fsdp), unless FSDP2 is to offload to the host
        if self.mesh.world.size() > 1 or self.cfg.train.cpu_offload:
            apply_fsdp(model, self.mesh, self.precision, cpu_offload=self.cfg.train.cpu_offload)
        self.autocast_dtype = autocast_dtype(model, self.precision)
        trained: torch.nn.Module = model
        return trained

    def parallelize_extra(self, model: torch.nn.Module) -> None:
        """Model-specific parallelism applied after SP and activation checkpointing, before the dense
        FSDP2 units (e.g. expert parallelism and the experts' own FSDP2 units, moe_causal_lm.py)."""
        return None

    def build_loader(self) -> ResumableLoader:
        from spindle.data.text import build_text_dataset, collate_rows

        data = self.cfg.data
        dataset = build_text_dataset(data.path, self.tokenizer, data.seq_len, data.packing, data.skip_bad_samples)
        s = dataset.stats
        if is_main_process():
            log.info(
                "data: %d documents -> %d rows of %d tokens (%s), %d label tokens; %d truncated to seq_len, "
                "%d bad lines skipped",
                s.documents,
                s.rows,
                data.seq_len,
                "packed" if data.packing else "one document per row",
                s.label_tokens,
                s.truncated,
                s.skipped,
            )
            if s.truncated:
                log.warning(
                    "data: %d documents were longer than data.seq_len=%d and truncated", s.truncated, data.seq_len
                )
        return resumable_loader(self, dataset, collate_rows)

    # ------------------------------------------------------------ step

    def loss_units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["shift_labels"] != IGNORE_INDEX).sum())  # the whole rows, before any SP split

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepOutput:
        rows = {k: batch[k].to(self.device) for k in (*TOKEN_KEYS, PADDING_MASK_KEY) if k in batch}
        samples, tokens = rows["input_ids"].shape[0], rows["input_ids"].numel()
        if self.mesh.dims.sp > 1:
            from spindle.distributed import ulysses_attention

            # Positions and labels were computed on the whole rows; each SP rank keeps its chunk.
            rows = ulysses_attention.shard_batch(rows, self.mesh.sp_rank, self.mesh.dims.sp)
        with self._autocast():
            out = causal_lm_output(model, rows, **self.model_kwargs(rows))
        return StepOutput(out.loss.float(), samples, tokens, self.output_metrics(out, rows))

    def model_kwargs(self, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Extra keyword arguments of the training forward of this rank's `rows` (after the SP split),
        e.g. output_router_logits for MoE."""
        return {}

    def output_metrics(self, out: Any, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        """Scalars to log from a micro-batch's forward output on this rank's `rows` (StepOutput.metrics)."""
        return {}

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        return {"family": self.family.name}

    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
        write_transformers_folder(model, state, self.cfg.model.path, out, dtype=self.cfg.export.dtype)
        return out if is_main_process() else None

    @classmethod
    def export_checkpoint(
        cls, family: CausalLMFamily, checkpoint: Path, model_path: Path, out: Path, dtype: str = "auto"
    ) -> Path:
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_path} has no config.json; pass --model PATH")
        check_export_dtype(dtype)
        model_cls: Any = family.model_cls()
        model = model_cls.from_pretrained(model_path, dtype=torch.float32)
        state = ckpt.read_checkpoint_model(checkpoint, model)
        write_transformers_folder(model, state, model_path, out, dtype=dtype)
        return out


def unique_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of tied parameters (lm_head.weight tied to the embeddings), as
    `save_pretrained` does: the config's `tie_word_embeddings` re-ties them on load."""
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in state_dict.items() if k not in aliases}


def write_transformers_folder(
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    source: str | Path,
    out: str | Path,
    max_shard_bytes: int = EXPORT_MAX_SHARD_BYTES,
    dtype: str = "auto",
) -> None:
    """Collective: `out` = config.json + generation_config.json + tokenizer + sharded safetensors.

    Weights are written shard by shard from every rank (`ckpt.save_hf_safetensors`) into `<out>.tmp`,
    which is renamed to `out` when complete, each tensor in its `export.dtype` (`spindle.train.precision`;
    auto: as the source folder stores it); a DTensor converts only this rank's shard. Config and generation
    config are the model's own (transformers' `save_pretrained` of them) with the config's `dtype` set to
    the weights' main dtype, so `from_pretrained(dtype="auto")` loads them as written; the tokenizer is the
    source folder's.
    """
    dtypes = export_dtypes(dtype, source)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    ckpt.save_hf_safetensors(dtypes.cast_all(unique_weights(model, state_dict)), tmp, max_shard_bytes)
    if is_main_process():
        hf_model: Any = model  # a transformers PreTrainedModel
        config = copy.deepcopy(hf_model.config)  # the training model's own config stays fp32
        config.dtype = dtypes.default
        config.save_pretrained(tmp)
        if getattr(hf_model, "generation_config", None) is not None:
            hf_model.generation_config.save_pretrained(tmp)
        load_tokenizer(source).save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    barrier()
