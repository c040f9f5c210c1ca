"""The experts part of a language-model task: what a mixture-of-experts checkpoint adds to the causal-LM,
VLM or omni task that holds it. It is chosen from the family record: a family whose folder has a checkpoint
adapter (`conversion.py: ADAPTER`, the per-expert <-> fused expert layouts) trains with it.

- Load: the expert tensors of the checkpoint are validated from the safetensors headers first (per-expert or
  fused layout; a missing expert, an unrecognised expert tensor or a wrong shape is an error naming the key),
  transformers' checkpoint conversion is made to apply to Spindle's patched class, and any missing/unexpected
  key after loading is an error (the family's checkpoint adapter).
- Loss: the patched forward adds `router_aux_loss_coef x load_balancing_loss_func` as transformers does,
  weighted by the micro-batch's tokens so that it survives the trainer's token-sum normalisation
  (spindle/models/qwen3_moe/patches.py). Padding (the rows' `attention_mask`) is kept out of the router
  statistics, as upstream does when given `attention_mask`. With `parallel.sp` the statistics are summed over
  the SP group first (spindle.ops.router_loss), so every SP rank holds the aux loss of the whole rows. Logged
  apart as `aux_loss`, a metric averaged over micro-batches and ranks (`Metric`).
- Expert load: real tokens routed to each expert per step over the global batch (`moe_tokens_per_expert`,
  summed over the MoE layers; each rank counts its own tokens, summed over every rank: data-parallel and SP)
  and the worst layer's max/mean (`moe_load_imbalance`).
- Parallelism: `parallel.ep` (spindle.distributed.expert_parallel) on top of the task's plan.
- Export: the layout the input checkpoint had (per-expert by default), the experts gathered one tensor at a
  time (spindle.export.transformers.write_moe_folder); offline exports stream them from the checkpoint.
- LoRA: `train.lora.targets` may name the fused experts (`experts.gate_up_proj`, `experts.down_proj`, or
  `experts` for both), adapted through PEFT's `target_parameters` (spindle.train.lora) and held stacked by
  expert, so that with `parallel.ep` they are split with the experts (spindle.train.expert_lora).

The MoE fields are read from `config.get_text_config()`: a VLM's text config, a causal LM's own config;
the expert count by `spindle.models.shared.moe_checkpoints.expert_count` (the configs name it differently).

A model without a router aux loss (DeepSeek-V3: its config has no `router_aux_loss_coef`; it balances the
experts with a bias on the routing scores, `e_score_correction_bias`, a buffer transformers loads and never
updates, so it is trained as loaded and exported unchanged) trains with the token loss alone, as stock
transformers' loss is: no router arguments are passed and no `aux_loss` / load metrics are logged (its
routing, sigmoid scores plus that bias, top groups then top experts, is not the softmax top-k the load
counts read from router logits).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from spindle.config import ConfigError
from spindle.contracts.family import CausalLMFamily, CheckpointAdapter
from spindle.contracts.parallel import ParallelPlan
from spindle.contracts.protocols import ParallelDimsLike
from spindle.contracts.task import Metric
from spindle.models.shared.moe_checkpoints import expert_count, expert_intermediate_size

if TYPE_CHECKING:
    from spindle.distributed.mesh import Mesh
    from spindle.distributed.sharded_load import TensorSource
    from spindle.export.transformers import ExportSource

# Not given to attention (spindle.data.text): the rows' padding, which the router statistics skip.
PADDING_MASK_KEY = "attention_mask"


class Experts:
    """A MoE family's experts, for one task instance (the classmethods of a task build one from the record)."""

    def __init__(self, family: CausalLMFamily, adapter: CheckpointAdapter) -> None:
        self.family = family
        self.adapter = adapter
        self.layout = adapter.default_layout  # the checkpoint's, once `building` validated it
        self._load: torch.Tensor | None = None  # [moe layers, experts] routed token counts this step
        self._config: Any = None
        self.router_aux_loss = True  # the model's forward adds one (`has_router_aux_loss`, set by `building`)

    @staticmethod
    def of(family: CausalLMFamily) -> Experts | None:
        """The family's experts part, or None for a dense family (its folder has no checkpoint adapter)."""
        adapter = family.adapter()
        return None if adapter is None else Experts(family, adapter)

    def config(self, path: str | Path) -> Any:
        """The checkpoint's transformers config (Any: mypy does not follow transformers)."""
        if self._config is None:
            from transformers import AutoConfig

            self._config = AutoConfig.from_pretrained(path)
        return self._config

    # ------------------------------------------------------------ before launch

    def check_plan(self, path: str | Path, dims: ParallelDimsLike) -> None:
        from spindle.distributed.expert_parallel import check_ep_layout

        try:
            check_ep_layout(dims, expert_count(self.config(path)))
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ------------------------------------------------------------ set-up

    def init_kwargs(self, path: str | Path, device_type: str) -> dict[str, Any]:
        """The model construction's experts kernel (both load paths)."""
        return {"experts_implementation": experts_implementation(self.config(path), device_type)}

    def load_full(self, path: str | Path, device_type: str, **kwargs: Any) -> torch.nn.Module:
        return load_moe_model(self.family, path, device_type, **kwargs)

    def checkpoint_sources(self, sources: dict[str, TensorSource]) -> dict[str, TensorSource]:
        """Per-expert checkpoints read straight into the fused gate_up_proj / down_proj (the family's adapter)."""
        return self.adapter.load_sources(sources)

    def plan(self, plan: ParallelPlan) -> ParallelPlan:
        """The task's plan with the experts sharded over `ep`."""
        return dataclasses.replace(plan, expert_parallel=True)

    @contextmanager
    def building(self, path: str | Path) -> Iterator[None]:
        """Around the model's build and load: the expert layout validated (keys and shapes) first, then its
        load-time conversion installed."""
        self.layout = self.adapter.layout(path)
        self.router_aux_loss = has_router_aux_loss(self.config(path))
        with self.adapter.loading(self.layout):
            yield

    # ------------------------------------------------------------ step

    def model_kwargs(self, rows: dict[str, torch.Tensor], mesh: Mesh) -> dict[str, Any]:
        if not self.router_aux_loss:
            return {}
        kwargs: dict[str, Any] = {"output_router_logits": True}
        if PADDING_MASK_KEY in rows:
            kwargs["router_mask"] = rows[PADDING_MASK_KEY]
        if mesh.dims.sp > 1:
            # this rank holds a slice of every row: the aux loss sums the router statistics over the SP group
            kwargs["router_group"] = mesh.sp.get_group()
        return kwargs

    def output_metrics(self, out: Any, rows: dict[str, torch.Tensor], path: str | Path) -> dict[str, Any]:
        if not self.router_aux_loss:
            return {}
        self._count_load(out.router_logits, rows.get(PADDING_MASK_KEY), path)
        # every SP rank holds the same whole-row aux loss: a mean over micro-batches and over the ranks
        return {"aux_loss": Metric(float(out.aux_loss.detach()), micro_batches="mean", ranks="mean")}

    @torch.no_grad()
    def _count_load(self, router_logits: tuple[torch.Tensor, ...], mask: torch.Tensor | None, path: Any) -> None:
        from spindle.ops.router_loss import router_statistics

        config = self.config(path).get_text_config()
        stats = router_statistics(router_logits, expert_count(config), config.num_experts_per_tok, mask)
        counts = stats.counts.to(torch.float64)
        self._load = counts if self._load is None else self._load + counts

    def step_metrics(self, mesh: Mesh, device: torch.device) -> dict[str, Any]:
        load, self._load = self._load, None
        if load is None:
            return {}
        if dist.is_initialized() and mesh.world.size() > 1:
            # Every rank counted its own tokens (data-parallel ranks their rows, SP ranks their slices of the
            # same rows): the global batch's load is the sum over the whole world.
            load = load.to(device)
            dist.all_reduce(load)
        load = load.cpu()
        per_layer_imbalance = load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-12)
        return {
            "moe_tokens_per_expert": [int(x) for x in load.sum(dim=0).tolist()],
            "moe_load_imbalance": float(per_layer_imbalance.max()),
        }

    # ------------------------------------------------------------ export

    def state(self) -> dict[str, Any]:
        return {"expert_layout": self.layout}

    def write_folder(
        self,
        model: torch.nn.Module,
        state: dict[str, torch.Tensor],
        source: str | Path,
        out: Path,
        dtype: str,
        rename: Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        extra_files: tuple[str, ...],
        finish: Callable[[Path, Any], None] | None,
    ) -> None:
        """Collective: the transformers folder with the experts in the checkpoint's layout."""
        from spindle.export.transformers import write_moe_folder

        write_moe_folder(
            self.adapter,
            model,
            state,
            source,
            out,
            self.layout,
            dtype=dtype,
            rename=rename,
            extra_files=extra_files,
            finish=finish,
        )

    def export_sources(
        self, model: torch.nn.Module, state: dict[str, torch.Tensor], model_path: Path, dense: dict[str, ExportSource]
    ) -> dict[str, ExportSource]:
        """`dense` (every tensor as it is) with the experts in the base checkpoint's layout: each fused expert
        tensor converted by the family's adapter (split per expert, or transposed) when it is read, one
        layer's tensor at a time. Validates the base's expert tensors first, naming a bad one."""
        from spindle.distributed.expert_parallel import expert_param_names

        layout = self.adapter.layout(model_path)
        out = dict(dense)
        for key in set(expert_param_names(model)):
            del out[key]
            convert = partial(_expert_layout, self.adapter, model, key, layout)
            out.update({name: (key, convert, meta) for name, meta in convert(state[key]).items()})
        return out

    def merge_base(self) -> Any:
        """What loads the base a LoRA is merged into: the family class with its expert layout converted."""
        return ExpertLayoutLoader(self.family, self.adapter)


def has_router_aux_loss(config: Any) -> bool:
    """Whether the MoE model's forward adds a router aux loss: transformers' config declares
    `router_aux_loss_coef` exactly for those (not DeepSeek-V3's: module docstring)."""
    return hasattr(config.get_text_config(), "router_aux_loss_coef")


def experts_implementation(config: Any, device_type: str) -> str:
    """transformers' fused experts kernel for this model: `grouped_mm` (one grouped GEMM per projection
    over the stacked weights), except on CPU when a weight row is not a multiple of 16 bytes, which the
    CPU grouped_mm kernel rejects ("strides should be multiple of 16 bytes"): then `batched_mm`
    (per-token batched GEMMs on gathered expert weights, also vectorised; never a loop over experts)."""
    if device_type == "cpu":
        row_bytes = 4  # fp32 master weights on CPU
        c = config.get_text_config()
        if (c.hidden_size * row_bytes) % 16 or (expert_intermediate_size(c) * row_bytes) % 16:
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

    def __init__(self, family: CausalLMFamily, adapter: CheckpointAdapter) -> None:
        self.family, self.adapter = family, adapter

    def from_pretrained(self, path: str | Path, **kwargs: Any) -> Any:
        layout = self.adapter.layout(path)
        extra = self.adapter.load_kwargs(layout)
        with self.adapter.loading(layout):
            model = cast(Any, self.family.model_cls()).from_pretrained(path, **kwargs, **extra)
        if extra:
            # A dequantising load (GPT-OSS's MXFP4): transformers records its converters on the model, and its
            # save_pretrained would write the dequantised tensors back under the quantised names ({name}_blocks),
            # which no load reads; the merged folder holds plain tensors under the model's names.
            model._weight_conversions = None
        return model


def load_moe_model(
    family: CausalLMFamily, path: str | Path, device_type: str = "cpu", **kwargs: Any
) -> torch.nn.Module:
    """The family's MoE ForCausalLM from `path` in fp32, every expert loaded from the checkpoint or an error."""
    from transformers import AutoConfig

    adapter = family.adapter()
    if adapter is None:
        raise ConfigError(f"family {family.name!r} declares no checkpoint adapter for its expert tensors")
    layout = adapter.layout(path)  # validates expert keys and shapes before any weight is read
    impl = experts_implementation(AutoConfig.from_pretrained(path), device_type)
    cls: Any = family.model_cls()  # a transformers PreTrainedModel class (Any to mypy)
    model: torch.nn.Module
    with adapter.loading(layout):
        model, info = cls.from_pretrained(
            path,
            dtype=torch.float32,
            output_loading_info=True,
            experts_implementation=impl,
            **kwargs,
            **adapter.load_kwargs(layout),
        )
    adapter.check_loading_info(info, str(path))
    return model
