"""What frozen weights are kept in (`train.frozen_dtype`). Export dtypes (`export.dtype`) are
spindle.export.dtypes'."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from spindle.config import ConfigError


def frozen_dtype(setting: str, precision: str) -> torch.dtype:
    """`train.frozen_dtype` against the run's resolved mixed precision ("bf16" / "no"): the dtype frozen
    parameters are stored in. auto: the compute precision (or the checkpoint's own narrower dtype
    under FSDP2, `frozen_storage`). bfloat16 without bf16 compute would feed
    bf16 weights to fp32 matmuls: refused, naming both keys."""
    if setting == "auto":
        return torch.bfloat16 if precision == "bf16" else torch.float32
    if setting == "bfloat16" and precision != "bf16":
        raise ConfigError(
            "train.frozen_dtype: bfloat16 stores frozen weights for bf16 compute, but this run computes in fp32 "
            f"(train.mixed_precision resolves to {precision!r}); set train.mixed_precision: bf16 or "
            "train.frozen_dtype: auto"
        )
    if setting not in ("float32", "bfloat16"):
        raise ConfigError(f"train.frozen_dtype must be auto, float32 or bfloat16; got {setting!r}")
    return torch.float32 if setting == "float32" else torch.bfloat16


def frozen_storage(
    setting: str, precision: str, *, upcast_at_gather: bool, stored: Mapping[str, torch.dtype]
) -> Callable[[str], torch.dtype]:
    """Per frozen parameter name (the model's, `base_layer.` included), the dtype it is stored in.

    `frozen_dtype(setting, precision)` for every parameter, except under `auto` with fp32 compute where
    FSDP2 shards the model (`upcast_at_gather`): a parameter the checkpoint stores in a narrower float
    (`stored`: {checkpoint name: dtype}, e.g. a bf16 Wan) keeps that dtype. Nothing is lost (the values
    are the checkpoint's), FSDP2's `param_dtype=float32` upcasts each block's weights at its all-gather
    (spindle.distributed.fsdp.mp_policy), so the step computes on exactly the fp32 numbers the fp32
    path would, while each rank's resident shard of the frozen base is half the size. Without FSDP2
    (one process) a bf16 weight would meet fp32 activations: fp32 there."""
    base = frozen_dtype(setting, precision)
    if setting != "auto" or base != torch.float32 or not upcast_at_gather:
        return lambda name: base

    from spindle.distributed.sharded_load import checkpoint_key

    def dtype(name: str) -> torch.dtype:
        narrow = stored.get(checkpoint_key(name))
        return narrow if narrow in (torch.bfloat16, torch.float16) else base

    return dtype


def store_frozen(model: torch.nn.Module, dtype: torch.dtype | Callable[[str], torch.dtype]) -> int:
    """Store `model`'s frozen floating parameters (requires_grad False: a LoRA run's base weights,
    frozen towers) in `dtype` (or `dtype(name)`), in place, before parallelisation (works on meta
    tensors too). Trainable parameters keep fp32 master weights. Modules the model keeps in fp32
    (diffusers / transformers `_keep_in_fp32_modules`: norms, time embedders, modulation tables) are
    left alone, as a from_pretrained in that dtype would. -> the number of parameters converted."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    converted = 0
    for name, param in model.named_parameters():
        target = dtype(name) if callable(dtype) else dtype
        if param.requires_grad or not param.is_floating_point() or param.dtype == target:
            continue
        if keep & set(name.split(".")):
            continue
        param.data = param.data.to(target)
        converted += 1
    return converted
