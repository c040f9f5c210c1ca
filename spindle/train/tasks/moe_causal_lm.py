"""The causal-LM task for mixture-of-experts models (Qwen3-MoE): the dense task plus experts.

- Load: the expert tensors of the checkpoint are validated from the safetensors headers first
  (per-expert or fused layout; a missing expert, an unrecognised expert tensor or a wrong shape is an
  error naming the key), transformers' checkpoint conversion is made to apply to Spindle's patched
  class, and any missing/unexpected key after loading is an error (the family's checkpoint adapter, `CausalLMFamily.adapter()`).
- Loss: the patched forward adds `router_aux_loss_coef x load_balancing_loss_func` as transformers
  does, weighted by the micro-batch's tokens so that it survives the trainer's token-sum
  normalisation (spindle/models/qwen3_moe/patches.py). Padding (the rows' `attention_mask`) is kept
  out of the router statistics, as upstream does when given `attention_mask`. With `parallel.sp` the
  statistics are summed over the SP group first (spindle.ops.router_loss), so every SP rank holds
  the aux loss of the whole rows. Logged apart as `aux_loss`.
- Expert load: real tokens routed to each expert per step over the global batch
  (`moe_tokens_per_expert`, summed over the MoE layers; each rank counts its own tokens, summed over
  every rank: data-parallel and SP) and the worst layer's max/mean (`moe_load_imbalance`).
- Parallelism: `parallel.ep` (spindle.distributed.expert_parallel) and `parallel.sp` (Ulysses) on top
  of the dense path.
- Export: the layout the input checkpoint had (per-expert by default).
- LoRA: `train.lora.targets` may name the fused experts (`experts.gate_up_proj`, `experts.down_proj`,
  or `experts` for both), adapted through PEFT's `target_parameters` (spindle.train.lora) and held
  stacked by expert, so that with `parallel.ep` they are split with the experts (spindle.train.expert_lora).

The class extends `CausalLMTask` cooperatively (every override goes through `super()`), so the VLM MoE
task (spindle/train/tasks/vlm_moe.py) combines it with the VLM task by inheritance. The MoE fields are
read from `config.get_text_config()`: a VLM's text config, a causal LM's own config.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from spindle.config import CausalLMJobConfig, ConfigError
from spindle.contracts.family import CausalLMFamily, CheckpointAdapter
from spindle.contracts.parallel import ParallelPlan
from spindle.distributed import checkpoint as ckpt
from spindle.distributed.mesh import is_main_process
from spindle.export.dtypes import check_export_dtype
from spindle.export.transformers import ExportSource, write_moe_folder
from spindle.train.tasks.causal_lm import PADDING_MASK_KEY, CausalLMTask

if TYPE_CHECKING:
    from spindle.distributed.mesh import Mesh, ParallelDims
    from spindle.distributed.sharded_load import TensorSource


def checkpoint_adapter(family: CausalLMFamily) -> CheckpointAdapter:
    """The MoE family's checkpoint adapter (expert layouts): every MoE family must declare one."""
    adapter = family.adapter()
    if adapter is None:
        raise ConfigError(
            f"family {family.name!r} trains with the MoE task but declares no checkpoint_adapter for its expert tensors"
        )
    return adapter


class MoECausalLMTask(CausalLMTask):
    name = "causal_lm_moe"
    supports_expert_parallel = True

    def __init__(
        self, cfg: CausalLMJobConfig, family: CausalLMFamily, mesh: Mesh, device: torch.device, precision: str
    ) -> None:
        super().__init__(cfg, family, mesh, device, precision)
        self.adapter = checkpoint_adapter(family)
        self.expert_layout = self.adapter.default_layout
        self._load: torch.Tensor | None = None  # [moe layers, experts] routed token counts this step

    @classmethod
    def check_plan(cls, cfg: CausalLMJobConfig, family: CausalLMFamily, dims: ParallelDims) -> None:
        from transformers import AutoConfig

        from spindle.distributed.expert_parallel import check_ep_layout

        super().check_plan(cfg, family, dims)  # the dense checks (ring refused for language models, ...)
        config = AutoConfig.from_pretrained(cfg.model.path)
        try:
            check_ep_layout(dims, config.get_text_config().num_experts)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ------------------------------------------------------------ set-up

    def load_model(self) -> torch.nn.Module:
        return load_moe_model(self.family, self.cfg.model.path, self.device.type, attn_implementation="sdpa")

    def model_init_kwargs(self) -> dict[str, Any]:
        return {"experts_implementation": experts_implementation(self.family_config, self.device.type)}

    def checkpoint_sources(self) -> dict[str, TensorSource]:
        # per-expert checkpoints read straight into the fused gate_up_proj / down_proj (the family's adapter)
        return self.adapter.load_sources(super().checkpoint_sources())

    def parallel_plan(self) -> ParallelPlan:
        # the base plan (a VLM's: SP in its language model only) with the experts sharded over `ep`
        return dataclasses.replace(super().parallel_plan(), expert_parallel=True)

    def build_model(self) -> torch.nn.Module:
        self.expert_layout = self.adapter.layout(self.cfg.model.path)  # validates expert keys and shapes first
        with self.adapter.loading(self.expert_layout):
            return super().build_model()

    # ------------------------------------------------------------ step

    def model_kwargs(self, rows: dict[str, torch.Tensor]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"output_router_logits": True}
        if PADDING_MASK_KEY in rows:
            kwargs["router_mask"] = rows[PADDING_MASK_KEY]
        if self.mesh.dims.sp > 1:
            # this rank holds a slice of every row: the aux loss sums the router statistics over the SP group
            kwargs["router_group"] = self.mesh.sp.get_group()
        return kwargs

    def output_metrics(self, out: Any, rows: dict[str, torch.Tensor]) -> dict[str, float]:
        from spindle.train.trainer import grad_accum_steps

        self._count_load(out.router_logits, rows.get(PADDING_MASK_KEY))
        # The trainer sums a metric over the step's micro-batches and over its loss ranks (with SP: every
        # SP rank, which all hold the same whole-row aux loss), then divides by the data-parallel size:
        # dividing by the accumulation count and the SP size makes that the mean over every micro-batch.
        accum = grad_accum_steps(self.cfg, self.mesh.dims.dp_size)
        return {"aux_loss": float(out.aux_loss.detach()) / (accum * self.mesh.dims.cp_size)}

    @torch.no_grad()
    def _count_load(self, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None) -> None:
        from spindle.ops.router_loss import router_statistics

        config = self.family_config.get_text_config()
        stats = router_statistics(router_logits, config.num_experts, config.num_experts_per_tok, mask)
        counts = stats.counts.to(torch.float64)
        self._load = counts if self._load is None else self._load + counts

    @property
    def family_config(self) -> Any:
        """The checkpoint's transformers config (Any: mypy does not follow transformers)."""
        if not hasattr(self, "_family_config"):
            from transformers import AutoConfig

            self._family_config = AutoConfig.from_pretrained(self.cfg.model.path)
        return self._family_config

    def step_metrics(self) -> dict[str, Any]:
        load, self._load = self._load, None
        if load is None:
            return {}
        if dist.is_initialized() and self.mesh.world.size() > 1:
            # Every rank counted its own tokens (data-parallel ranks their rows, SP ranks their slices
            # of the same rows): the global batch's load is the sum over the whole world.
            load = load.to(self.device)
            dist.all_reduce(load)
        load = load.cpu()
        per_layer_imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)
        return {
            "moe_tokens_per_expert": [int(x) for x in load.sum(dim=0).tolist()],
            "moe_load_imbalance": float(per_layer_imbalance.max()),
        }

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        return {**super().state(), "expert_layout": self.expert_layout}

    def export(self, model: torch.nn.Module, out: Path) -> Path | None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self.cfg.train.lora is not None:  # the attention adapters: a PEFT folder, as for dense models
            return super().export(model, out)

        # a model's state dict holds tensors (DTensors under FSDP2/EP), not the nested values DCP's ValueType allows
        state = cast("dict[str, torch.Tensor]", get_model_state_dict(model))
        self.write_folder(
            self.family, self.adapter, model, state, self.cfg.model.path, out, self.expert_layout, self.cfg.export.dtype
        )
        return out if is_main_process() else None

    @classmethod
    def merge_base(cls, family: CausalLMFamily) -> Any:
        return ExpertLayoutLoader(family)

    @classmethod
    def write_folder(
        cls,
        family: CausalLMFamily,
        adapter: CheckpointAdapter,
        model: torch.nn.Module,
        state: dict[str, torch.Tensor],
        source: str | Path,
        out: Path,
        layout: str,
        dtype: str,
    ) -> None:
        """Collective: `write_moe_folder` under the checkpoint's names (`export_layout`) with the task's extra files."""
        write_moe_folder(
            adapter,
            model,
            state,
            source,
            out,
            layout,
            dtype=dtype,
            rename=lambda m, s: cls.export_layout(family, m, s),
            extra_files=cls.export_files,
            finish=cls.finish_export(family, source),
        )

    @classmethod
    def export_checkpoint(
        cls, family: CausalLMFamily, checkpoint: Path, model_path: Path, out: Path, dtype: str = "auto"
    ) -> Path:
        if not (model_path / "config.json").is_file():
            raise FileNotFoundError(f"base model {model_path} has no config.json; pass --model PATH")
        check_export_dtype(dtype)
        if json.loads((checkpoint / ckpt.TRAINER_STATE).read_text()).get("lora") is not None:
            return super().export_checkpoint(family, checkpoint, model_path, out, dtype)
        # (export_sources validates the base's expert tensors, naming a bad one, before any weight is read)
        if not cls.export_streamed(family, checkpoint, model_path, out, dtype):
            raise RuntimeError(f"{family.name}: the export names cannot be traced to the model's tensors")
        return out

    @classmethod
    def export_sources(
        cls, family: CausalLMFamily, model: torch.nn.Module, state: dict[str, torch.Tensor], model_path: Path
    ) -> dict[str, ExportSource]:
        """The experts in the base checkpoint's layout: each fused expert tensor converted by the family's
        adapter (split per expert, or transposed) when it is read, one layer's tensor at a time."""
        from functools import partial

        from spindle.distributed.expert_parallel import expert_param_names

        adapter = checkpoint_adapter(family)
        layout = adapter.layout(model_path)
        experts = set(expert_param_names(model))
        out = super().export_sources(family, model, state, model_path)
        for key in experts:
            del out[key]
            convert = partial(_expert_layout, adapter, model, key, layout)
            out.update({name: (key, convert, meta) for name, meta in convert(state[key]).items()})
        return out


def experts_implementation(config: Any, device_type: str) -> str:
    """transformers' fused experts kernel for this model: `grouped_mm` (one grouped GEMM per projection
    over the stacked weights), except on CPU when a weight row is not a multiple of 16 bytes, which the
    CPU grouped_mm kernel rejects ("strides should be multiple of 16 bytes"): then `batched_mm`
    (per-token batched GEMMs on gathered expert weights, also vectorised; never a loop over experts)."""
    if device_type == "cpu":
        row_bytes = 4  # fp32 master weights on CPU
        c = config.get_text_config()
        if (c.hidden_size * row_bytes) % 16 or (c.moe_intermediate_size * row_bytes) % 16:
            return "batched_mm"
    return "grouped_mm"


def _expert_layout(
    adapter: CheckpointAdapter, model: torch.nn.Module, key: str, layout: str, value: torch.Tensor
) -> dict[str, torch.Tensor]:
    """One fused expert tensor of the model -> its tensors in the checkpoint's `layout`."""
    return adapter.to_layout(model, {key: value}, layout)


class ExpertLayoutLoader:
    """`from_pretrained` of the family's class with its checkpoint's expert layout converted on load (the
    adapter's loading context): what a LoRA merge loads the base with."""

    def __init__(self, family: CausalLMFamily) -> None:
        self.family = family

    def from_pretrained(self, path: str | Path, **kwargs: Any) -> Any:
        adapter = checkpoint_adapter(self.family)
        with adapter.loading(adapter.layout(path)):
            return cast(Any, self.family.model_cls()).from_pretrained(path, **kwargs)


def load_moe_model(
    family: CausalLMFamily, path: str | Path, device_type: str = "cpu", **kwargs: Any
) -> torch.nn.Module:
    """The family's MoE ForCausalLM from `path` in fp32, every expert loaded from the checkpoint or an error."""
    from transformers import AutoConfig

    adapter = checkpoint_adapter(family)
    layout = adapter.layout(path)  # validates expert keys and shapes before any weight is read
    impl = experts_implementation(AutoConfig.from_pretrained(path), device_type)
    cls: Any = family.model_cls()  # a transformers PreTrainedModel class (Any to mypy)
    model: torch.nn.Module
    with adapter.loading(layout):
        model, info = cls.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True, experts_implementation=impl, **kwargs
        )
    adapter.check_loading_info(info, str(path))
    return model
