"""Whether a language-model job packs documents into rows (`data.packing`, resolved).

Unset (`null`, the default) packs, except for decoders with linear-attention layers (Qwen3.5's Gated DeltaNet,
config.json `layer_types`): transformers' torch path of those layers takes no document boundaries (its chunked
recurrence and causal convolution ignore `cu_seqlens`), so a packed row would carry one document's state into the
next; and except for a family that refuses packing (`CausalLMFamily.packing_refused`, with its reason). The task
and the run record (spindle.train.run_record) read it here, below both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spindle.contracts.family import CausalLMFamily


def read_config(model_path: str | Path) -> dict[str, Any]:
    """A transformers folder's config.json."""
    config: dict[str, Any] = json.loads((Path(model_path) / "config.json").read_text())
    return config


def has_linear_attention(config: dict[str, Any]) -> bool:
    """The language model of a config.json (its own, or a VLM's `text_config`) has linear-attention layers."""
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or ())


def packs(packing: bool | None, model_path: str | Path, family: CausalLMFamily | None = None) -> bool:
    """`data.packing` resolved for the model at `model_path` of `family` (module doc)."""
    if packing is not None:
        return packing
    if getattr(family, "packing_refused", ""):  # a language family's record (a DiT's has no such field)
        return False
    return not has_linear_attention(read_config(model_path))
