"""Which attention a language model trains with (`model.attn_implementation`), checked before any work.

Settings (docs/training.md, "Attention backends"):

- `sdpa`: transformers' sdpa; packed rows get a dense `[rows, 1, S, S]` document mask (memory ~S^2).
- `varlen`: Spindle's per-document causal SDPA from the position ids (spindle/ops/varlen_attention.py);
  memory linear in S, any device.
- `flash_attention_2` / `flash_attention_3`: the same boundaries through flash-attention's varlen kernel
  (CUDA, bf16, the `flash_attn` / `flash_attn_interface` package installed).
- `flex_attention`: transformers' flex attention with a block mask (CUDA).
- `auto`: the fastest of these that can run: flash_attention_3 (Hopper) > flash_attention_2 when
  installed on CUDA under bf16, else varlen; sdpa for models with sliding-window layers (which only
  the dense path implements); transformers' eager attention for a model class that refuses sdpa
  (`_supports_sdpa = False`: GPT-OSS, whose per-head attention sinks sdpa and Spindle's varlen kernels do
  not compute). Eager takes the same dense per-document mask as sdpa, and materialises the attention
  weights.

A setting that cannot run is refused with the reason (`resolve_attention` raises ValueError).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from spindle.ops.varlen_attention import FLASH_MODULES

SETTINGS = ("auto", "sdpa", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention")
# what each flash kernel's package is called on PyPI (the module names differ)
_FLASH_PACKAGES = {"flash_attention_2": "flash-attn", "flash_attention_3": "flash-attn 3 (its hopper/ build)"}


def has_sliding_window(config: Any) -> bool:
    """The text config (a transformers config or its config.json dict) has sliding-window layers."""
    get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
    if layer_types := get("layer_types"):
        return any(t != "full_attention" for t in layer_types)
    return bool(get("use_sliding_window")) and get("sliding_window") is not None


def installed(kernel: str) -> bool:
    """The flash kernel's module can be imported."""
    return importlib.util.find_spec(FLASH_MODULES[kernel]) is not None


def _cuda_capability() -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)


def supports_sdpa(model_class: Any) -> bool:
    """transformers' sdpa computes the model's attention: its class does not refuse it (`_supports_sdpa`)."""
    return bool(model_class._supports_sdpa)


def resolve_attention(
    setting: str, *, device_type: str, precision: str, text_config: Any, model_class: Any = None
) -> str:
    """The attention a run uses: `setting` itself when it can run, `auto`'s pick; ValueError naming
    `model.attn_implementation`, why, and what to set otherwise.

    `precision`: train.mixed_precision ("auto" is bf16 on CUDA, the only device flash runs on); `text_config`: the language model's
    config (dict or object); `model_class`: the transformers class trained (None: one that supports sdpa).
    Under parallel.sp the sliding-window and sink layers run Spindle's windowed kernel whatever the setting
    (spindle.distributed.ulysses_attention)."""
    if setting not in SETTINGS:
        raise ValueError(f"model.attn_implementation must be one of {SETTINGS}, got {setting!r}")
    sliding = has_sliding_window(text_config)
    key = f"model.attn_implementation={setting}"
    if model_class is not None and not supports_sdpa(model_class):
        if setting == "auto":
            return "eager"
        if setting in ("sdpa", "varlen", *FLASH_MODULES):
            raise ValueError(
                f"{key}: transformers refuses sdpa for {model_class.__name__} (_supports_sdpa = False: its attention "
                "adds a learned sink logit per head, which sdpa and Spindle's varlen/flash kernels do not compute); "
                "set model.attn_implementation: auto (transformers' eager attention, with the sinks)"
            )
    if setting == "auto":
        if sliding:
            return "sdpa"
        if device_type == "cuda" and precision in ("bf16", "auto"):
            if installed("flash_attention_3") and _cuda_capability()[0] == 9:
                return "flash_attention_3"
            if installed("flash_attention_2"):
                return "flash_attention_2"
        return "varlen"
    if setting in ("varlen", *FLASH_MODULES) and sliding:
        raise ValueError(
            f"{key}: the model has sliding-window layers (layer_types / use_sliding_window), which Spindle's varlen "
            "attention does not implement; set model.attn_implementation: sdpa (or auto)"
        )
    if setting in (*FLASH_MODULES, "flex_attention") and device_type != "cuda":
        raise ValueError(f"{key}: runs on CUDA only (this run is on {device_type}); use varlen (or auto)")
    if setting in FLASH_MODULES:
        if not installed(setting):
            raise ValueError(
                f"{key}: the {FLASH_MODULES[setting]!r} module is not installed (package {_FLASH_PACKAGES[setting]}); "
                "install it, or use varlen (or auto)"
            )
        if precision not in ("bf16", "auto"):
            raise ValueError(
                f"{key}: flash-attention kernels take bf16/fp16 inputs, and this run computes in fp32 "
                "(train.mixed_precision); set train.mixed_precision: bf16, or use varlen"
            )
        if setting == "flash_attention_3" and _cuda_capability()[0] != 9:
            raise ValueError(f"{key}: flash-attention 3 needs a Hopper GPU (sm90); use flash_attention_2 or varlen")
    return setting
