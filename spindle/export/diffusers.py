"""Diffusers folders: a whole pipeline folder with the trained transformer (written shard by shard from
every rank, or from an in-memory state dict), and LoRA exports (diffusers' own `save_lora_weights` file, the
original/ComfyUI layout, the model card, optionally the merged pipeline). Stock diffusers loads them."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from spindle.contracts.family import import_object
from spindle.distributed.mesh import barrier, is_main_process
from spindle.export.dtypes import ExportDtypes, export_dtypes
from spindle.export.record import EXPORT_RECORD, LORA_WEIGHTS, write_export_record, write_lora_card
from spindle.export.safetensors import save_hf_safetensors


def transformer_class(root: str | Path, component: str = "transformer") -> Any:
    """The diffusers transformer class named in `root/<component>/config.json`."""
    import diffusers

    cfg_path = Path(root) / component / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: the checkpoint has no transformer component")
    cls_name = json.loads(cfg_path.read_text())["_class_name"]
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise ValueError(f"{cfg_path} names {cls_name!r}, which diffusers {diffusers.__version__} does not provide")
    return cls


def load_transformer(
    root: str | Path, dtype: torch.dtype = torch.float32, component: str = "transformer"
) -> torch.nn.Module:
    """Load the diffusers transformer `component` of the pipeline folder `root` (every weight, on the host)."""
    model: torch.nn.Module = transformer_class(root, component).from_pretrained(Path(root) / component, dtype=dtype)
    return model


def transformer_from_config(root: str | Path, component: str = "transformer") -> torch.nn.Module:
    """The transformer `component` of `root` built from its config alone, fp32, its parameters on the meta
    device (no weight read; buffers computed as diffusers computes them)."""
    from spindle.distributed.sharded_load import empty_weights

    cls = transformer_class(root, component)
    with empty_weights():
        model: torch.nn.Module = cls.from_config(cls.load_config(Path(root) / component))
    return model


LORA_FILE = LORA_WEIGHTS


LORA_ORIGINAL_FILE = "original_layout_lora.safetensors"


def export_lora(
    family: Any,
    base: str | Path,
    adapters: dict[str, torch.Tensor],
    out: str | Path,
    merge: bool,
    max_text_length: int | None = None,
    dtypes: ExportDtypes | None = None,
    component: str = "transformer",
    size: dict[str, int] | None = None,
) -> Path:
    """Write `out/lora/` (diffusers' LoRA file + the original-layout file, `spindle.json` naming the base
    model and the trained text length, and a README.md model card with the lines that use it) and, with
    `merge`, `out/merged/` (the full pipeline with the LoRA fused into the transformer). Written to
    `<out>.tmp`, then renamed.

    `dtypes` (default: the base transformer's, `export.dtype: auto`): the adapters are written in its
    default dtype (they have no counterpart in the base); the merged transformer tensor by tensor.
    The fusion itself runs in fp32.

    `adapters`: diffusers-layout LoRA (`<module>.lora_A.weight`, alpha / rank folded into lora_B).
    The diffusers file is written by the family pipeline's own `save_lora_weights`, so
    `<Pipeline>.load_lora_weights(out/lora)` loads it in stock diffusers (a two-expert checkpoint's
    `transformer_2` LoRA with `load_into_transformer_2=True`; `component` is recorded in spindle.json).
    """
    import logging

    from safetensors.torch import save_file

    dtypes = dtypes or export_dtypes("auto", Path(base) / component)
    fused_source = adapters
    adapters = {k: v.to(dtypes.default) for k, v in adapters.items()}
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    family.lora_pipeline_class().save_lora_weights(
        tmp / "lora", transformer_lora_layers=adapters, weight_name=LORA_FILE
    )
    if family.lora_original is not None:
        try:
            original = import_object(family.lora_original)(adapters)
        except ValueError as e:  # targets outside the original layout: the diffusers file still serves
            logging.getLogger("spindle.train").warning("no original-layout LoRA file written: %s", e)
        else:
            save_file(original, tmp / "lora" / LORA_ORIGINAL_FILE, metadata={"format": "pt", "family": family.name})
    base_path = str(Path(base).resolve())
    trained = {"family": family.name, "max_text_length": max_text_length}
    expert = {} if component == "transformer" else {"component": component}
    write_export_record(tmp / "lora", base_model=base_path, **trained, **expert)
    write_lora_card(
        tmp / "lora",
        family.name,
        base_path,
        family.checkpoint.pipeline,
        max_text_length,
        lora_dir=str(out.resolve() / "lora"),
        media=family.inference_spec().media if family.inference else "image",
        component=component,
        images=family.options.images[0],
        size=size,
        lora_loader=family.checkpoint.lora_loader,
        text_length_arg="max_sequence_length" in inspect.signature(family.pipeline_class().__call__).parameters,
    )
    if merge:
        model: Any = load_transformer(base, component=component)  # a diffusers ModelMixin (PEFT loader methods)
        model.load_lora_adapter({f"transformer.{k}": v for k, v in fused_source.items()}, prefix="transformer")
        model.fuse_lora(lora_scale=1.0)
        model.unload_lora()
        export_pipeline(base, model.state_dict(), tmp / "merged", trained, dtypes, component)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"


def check_state_names(
    expected: set[str],
    got: set[str],
    source_root: str | Path,
    require_all: bool = True,
    component: str = "transformer",
) -> None:
    """The trained tensor names against the base transformer `component`'s (`require_all`: every one present)."""
    missing = sorted(expected - got) if require_all else []
    unexpected = sorted(got - expected)
    if missing or unexpected:
        cls = transformer_class(source_root, component).__name__
        raise RuntimeError(
            f"trained weights do not fit {cls} of {source_root}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; was the run trained from another base model? pass --model PATH"
        )


def start_pipeline_export(source_root: str | Path, out: str | Path, component: str = "transformer") -> Path:
    """`<out>.tmp` holding every component of `source_root` but the trained `component` (which the caller
    writes); a two-expert checkpoint's other expert is copied byte for byte."""
    source_root = Path(source_root)
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source_root, tmp, ignore=lambda folder, names: [component] if Path(folder) == source_root else [])
    return tmp


def finish_pipeline_export(
    source_root: str | Path,
    tmp: Path,
    out: str | Path,
    trained: dict[str, Any] | None,
    component: str = "transformer",
) -> Path:
    """Complete `tmp` (the trained component's diffusers config where the writer left none, `spindle.json`)
    and rename it to `out`."""
    config = tmp / component / "config.json"
    if not config.is_file():  # the trained transformer has the base one's architecture: its config as is
        shutil.copy2(Path(source_root) / component / "config.json", config)
    (tmp / EXPORT_RECORD).unlink(missing_ok=True)  # the source's record describes another training
    if trained is not None:
        write_export_record(tmp, **trained)
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def export_pipeline_sharded(
    source_root: str | Path,
    model: torch.nn.Module,
    out: str | Path,
    trained: dict[str, Any] | None,
    dtypes: ExportDtypes,
    component: str = "transformer",
) -> Path | None:
    """Collective: the pipeline folder with the trained (FSDP2-sharded) transformer `component`, each rank
    writing its own parameter shards (`save_hf_safetensors`): the whole model is never gathered on
    one rank. Returns the folder on rank 0, None elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = cast("dict[str, torch.Tensor]", get_model_state_dict(model))  # DTensors: no gather
    expected = set(transformer_from_config(source_root, component).state_dict())
    check_state_names(expected, set(state), source_root, component=component)
    tmp = Path(out).with_name(Path(out).name + ".tmp")
    if is_main_process():
        start_pipeline_export(source_root, out, component)
    barrier()
    save_hf_safetensors(dtypes.cast_all(state), tmp / component, weights_name=DIFFUSERS_WEIGHTS)
    result = finish_pipeline_export(source_root, tmp, out, trained, component) if is_main_process() else None
    barrier()
    return result


def export_pipeline(
    source_root: str | Path,
    state_dict: dict[str, torch.Tensor],
    out: str | Path,
    trained: dict[str, Any] | None = None,
    dtypes: ExportDtypes | None = None,
    component: str = "transformer",
) -> Path:
    """Write a diffusers pipeline folder from an in-memory transformer state dict (one process): every
    component of `source_root`, with the trained transformer `component` (a two-expert checkpoint's trained
    expert: the other one is copied byte for byte), and `trained` (how it was trained) as `spindle.json`
    (`spindle.export.record`).

    The transformer is rebuilt from its own diffusers config and saved with diffusers' `save_pretrained`,
    so `config.json` carries only diffusers keys and stock diffusers loads the folder with no Spindle code.
    Its tensors are written in `dtypes` (default: as the source transformer stores them, `export.dtype:
    auto`), converted one tensor at a time into a model built on the meta device: no second full-size
    copy of the weights besides `state_dict`. Written to `<out>.tmp` first, then renamed.
    """
    import diffusers

    source_root = Path(source_root)
    dtypes = dtypes or export_dtypes("auto", source_root / component)
    tmp = start_pipeline_export(source_root, out, component)
    config = json.loads((source_root / component / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(source_root / component))
    check_state_names(set(model.state_dict()), set(state_dict), source_root, component=component)
    # assign: each meta tensor becomes the converted trained tensor (fresh storage, or the tensor itself
    # when its dtype already matches); non-persistent buffers stay on meta and are not saved.
    model.load_state_dict(dtypes.cast_all(state_dict), assign=True)
    model.save_pretrained(tmp / component, safe_serialization=True)
    return finish_pipeline_export(source_root, tmp, out, trained, component)


def export_pipeline_streamed(
    checkpoint: Path,
    model_path: Path,
    out: Path,
    trained: dict[str, Any],
    dtypes: ExportDtypes,
    component: str = "transformer",
) -> Path:
    """One process, without building the model: the pipeline folder with the trained transformer `component`
    streamed shard by shard from a training checkpoint (an untrained tensor: the base file's)."""
    from spindle.distributed import checkpoint as ckpt
    from spindle.export.streamed import checkpoint_then_base, write_streamed

    saved = ckpt.saved_model_tensors(checkpoint)
    expected = transformer_from_config(model_path, component).state_dict()
    check_state_names(set(expected), set(saved), model_path, require_all=False, component=component)
    tmp = start_pipeline_export(model_path, out, component)
    read = checkpoint_then_base(checkpoint, model_path / component)
    write_streamed(expected, read, tmp / component, DIFFUSERS_WEIGHTS, dtypes)
    return finish_pipeline_export(model_path, tmp, out, trained, component)
