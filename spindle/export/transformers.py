"""Transformers folders: config, generation config, tokenizer (and a VLM's processor files) beside sharded
safetensors written shard by shard from every rank, in the input's precision and expert layout; stock
`from_pretrained` loads them with no Spindle code."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from spindle.contracts.family import CheckpointAdapter
from spindle.distributed.mesh import barrier, is_main_process
from spindle.export.dtypes import ExportDtypes, export_dtypes
from spindle.export.safetensors import append_safetensors, save_hf_safetensors

EXPORT_MAX_SHARD_BYTES = 5 << 30  # transformers' default max_shard_size (5GB)


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def unique_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of tied parameters (lm_head.weight tied to the embeddings), as
    `save_pretrained` does: the config's `tie_word_embeddings` re-ties them on load."""
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {k: v for k, v in state_dict.items() if k not in aliases}


def classification_config(config: Any, model_cls: Any, pad_token_id: int) -> Any:
    """A causal-LM `config` made the one of a standard reward-model folder: one label (a scalar score), the
    sequence-classification class in `architectures` (what `AutoModelForSequenceClassification` and tools read),
    and `pad_token_id` set, since the head pools each row at its last token that is not padding (read from the
    text config, `get_text_config()`: a vision-language config's own). The training model is built from it, so
    `write_transformers_folder` writes it as it is."""
    config.num_labels = 1
    config.architectures = [model_cls.__name__]
    config.pad_token_id = pad_token_id
    config.get_text_config().pad_token_id = pad_token_id
    return config


def write_transformers_folder(
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    source: str | Path,
    out: str | Path,
    max_shard_bytes: int = EXPORT_MAX_SHARD_BYTES,
    extra_files: tuple[str, ...] = (),
    dtype: str = "auto",
    finish: Callable[[Path, ExportDtypes], None] | None = None,
    more: Callable[[ExportDtypes], Iterator[dict[str, torch.Tensor]]] | None = None,
) -> None:
    """Collective: `out` = config.json + generation_config.json + tokenizer + sharded safetensors, plus
    `extra_files` of the source folder that exist (e.g. a VLM's preprocessor_config.json). `more(dtypes)`
    yields further tensors a group at a time, already in their export names and dtypes (a MoE's experts
    converted to the checkpoint's layout, one layer's tensor at a time: `append_safetensors`).

    Weights are written shard by shard from every rank (`save_hf_safetensors`) into `<out>.tmp`,
    which is renamed to `out` when complete, each tensor in its `export.dtype` (`spindle.train.precision`;
    auto: as the source folder stores it); a DTensor converts only this rank's shard. Config and generation
    config are the model's own (transformers' `save_pretrained` of them) with the config's `dtype` set to
    the weights' main dtype, so `from_pretrained(dtype="auto")` loads them as written; the tokenizer is the
    source folder's. `finish(folder, dtypes)` completes the folder on the main process before it is renamed
    (an omni model's untrained sub-models and whole config).
    """
    dtypes = export_dtypes(dtype, source)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    save_hf_safetensors(dtypes.cast_all(unique_weights(model, state_dict)), tmp, max_shard_bytes)
    if more is not None:
        append_safetensors(tmp, more(dtypes), max_shard_bytes)
    if is_main_process():
        finish_transformers_folder(model, dtypes, source, tmp, out, extra_files, finish)
    barrier()


def finish_transformers_folder(
    model: torch.nn.Module,
    dtypes: ExportDtypes,
    source: str | Path,
    tmp: Path,
    out: Path,
    extra_files: tuple[str, ...],
    finish: Callable[[Path, ExportDtypes], None] | None = None,
) -> None:
    """Beside the weights in `tmp`: the config (its `dtype` the weights' main one), generation config,
    the source's tokenizer and `extra_files`, then the task's `finish(tmp, dtypes)`; then `tmp` becomes `out`."""
    hf_model: Any = model  # a transformers PreTrainedModel
    config = copy.deepcopy(hf_model.config)  # the training model's own config stays fp32
    config.dtype = dtypes.default
    if hasattr(config, "quantization_config"):
        # the weights written are plain tensors: a checkpoint quantised on disk (GPT-OSS's MXFP4) trained dequantised,
        # and its quantization_config would make transformers read them as quantised
        del config.quantization_config
    config.save_pretrained(tmp)
    if getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(tmp)
    load_tokenizer(source).save_pretrained(tmp)
    for name in extra_files:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, tmp / name)
    if finish is not None:
        finish(tmp, dtypes)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def write_moe_folder(
    adapter: CheckpointAdapter,
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    source: str | Path,
    out: str | Path,
    layout: str,
    dtype: str = "auto",
    rename: Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    extra_files: tuple[str, ...] = (),
    finish: Callable[[Path, Any], None] | None = None,
) -> None:
    """Collective: `write_transformers_folder` with the experts in `layout`, weights in `dtype` (`export.dtype`).

    Dense tensors stay sharded and are written rank by rank (DCP's HF writer). Expert tensors (DTensors
    under EP/FSDP2) are gathered whole one at a time, converted by the family's adapter and appended by
    the main process: at most one layer's expert tensor and one output file are whole in memory, never all
    the experts. `rename`: the model's names -> the checkpoint's (a VLM's `export_layout`, per-expert keys
    included), worked out once on meta tensors. `finish`: completes the folder (an omni model's untrained
    sub-models and whole config).
    """
    from spindle.distributed.expert_parallel import expert_param_names, to_full

    expert_keys = [k for k in expert_param_names(model) if k in state_dict]
    dense = {k: v for k, v in state_dict.items() if k not in set(expert_keys)}
    converted_meta = {
        k: adapter.to_layout(model, {k: torch.empty(state_dict[k].shape, device="meta")}, layout) for k in expert_keys
    }
    before = [*dense, *(n for k in expert_keys for n in converted_meta[k])]
    after = list(rename(model, dict.fromkeys(before, torch.empty(0))) if rename is not None else before)
    if len(after) != len(before):
        raise RuntimeError("the export's renaming merged or dropped tensor names")
    final = dict(zip(before, after, strict=True))

    def experts(dtypes: Any) -> Iterator[dict[str, torch.Tensor]]:
        for key in expert_keys:  # collective per tensor under EP / FSDP2
            whole = to_full(state_dict[key]).detach().cpu()
            yield {
                final[n]: dtypes.cast(final[n], t) for n, t in adapter.to_layout(model, {key: whole}, layout).items()
            }
            del whole

    state = {final[k]: v for k, v in dense.items()}
    write_transformers_folder(
        model, state, source, out, dtype=dtype, extra_files=extra_files, finish=finish, more=experts
    )


# (model tensor name, its whole value -> {export name: tensor} or None for as-is, the export tensor on meta)
ExportSource = tuple[str, Callable[[torch.Tensor], dict[str, torch.Tensor]] | None, torch.Tensor]


def export_streamed(
    model_cls: Any,
    checkpoint: Path,
    model_path: Path,
    out: Path,
    dtype: str,
    sources: Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, ExportSource]],
    layout: Callable[[torch.nn.Module, dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    extra_files: tuple[str, ...] = (),
    finish: Callable[[Path, ExportDtypes], None] | None = None,
) -> bool:
    """One process: a transformers folder written shard by shard from a training checkpoint, without building
    the model. The names come from a meta `model_cls` through `sources` (export name -> the model tensor and
    its conversion) and `layout` (the checkpoint's names); each trained tensor is read whole from the
    checkpoint (one at a time) and converted, an untrained one is the base file's under its own name.
    -> False when the layout's names cannot be traced to the model's tensors."""
    from spindle.distributed import checkpoint as ckpt
    from spindle.distributed.sharded_load import empty_weights
    from spindle.export.streamed import SafetensorsFolder, write_streamed

    with empty_weights():  # the class's own config part (an omni model's thinker reads its section)
        model = model_cls._from_config(model_cls.config_class.from_pretrained(model_path))
    model.tie_weights()  # not done under empty_weights; `unique_weights` finds the tied names by it
    state = model.state_dict()
    traced = sources(model, state)
    origin = {id(meta): (fqn, convert, name) for name, (fqn, convert, meta) in traced.items()}
    named = unique_weights(model, layout(model, {n: m for n, (_, _, m) in traced.items()}))
    if not all(id(t) in origin for t in named.values()):
        return False
    source_of = {name: origin[id(t)] for name, t in named.items()}
    saved = set(ckpt.saved_model_tensors(checkpoint))
    if unknown := sorted(saved - set(state)):
        raise RuntimeError(
            f"the checkpoint's tensors do not fit {model_cls.__name__} of {model_path}: unexpected {unknown[:5]}; "
            "was the run trained from another base model? pass --model PATH"
        )
    base = SafetensorsFolder(model_path)

    def read(names: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        by_fqn: dict[str, list[str]] = {}
        for n in names:
            by_fqn.setdefault(source_of[n][0], []).append(n)
        for fqn, wanted in by_fqn.items():  # one trained tensor whole at a time (a layer's fused experts)
            if fqn not in saved:  # not trained: the base file's, by its own name
                out.update(base.read(wanted))
                continue
            value = ckpt.read_model_tensors(checkpoint, [fqn])[fqn]
            convert = source_of[wanted[0]][1]  # one conversion per model tensor
            converted = {fqn: value} if convert is None else convert(value)
            out.update({n: converted[source_of[n][2]] for n in wanted})
            del value, converted
        return out

    dtypes = export_dtypes(dtype, model_path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # indexed even as one file, as the in-training export (DCP's writer) names it
    write_streamed(named, read, tmp, "model.safetensors", dtypes, EXPORT_MAX_SHARD_BYTES, single_file=False)
    finish_transformers_folder(model, dtypes, model_path, tmp, out, extra_files, finish)
    return True
