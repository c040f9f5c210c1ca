"""Tiny random checkpoints for tests: each family's builder (`tiny.py: build_tiny` in its folder,
`FAMILY.tiny_model`), by family name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spindle.contracts.family import CausalLMFamily, import_object
from spindle.registry import get_family


def build_tiny(family: str, out: str | Path, seed: int = 0, **overrides: Any) -> Path:
    record = get_family(family)
    path: Path = import_object(record.required_code("tiny_model"))(out, seed=seed, **overrides)
    return path


def with_expert_layout(family: str, src: str | Path, out: str | Path, layout: str) -> Path:
    """A copy of a MoE family's checkpoint folder `src` with its expert tensors rewritten in `layout` (the
    family's checkpoint adapter: e.g. "per_expert", "fused", "fused_transposed"); the other files as they are."""
    import shutil

    from safetensors.torch import load_file, save_file

    record = get_family(family)
    adapter = record.adapter() if isinstance(record, CausalLMFamily) else None
    if adapter is None:
        raise ValueError(f"family {family!r} declares no checkpoint adapter (expert layouts)")
    out = Path(out)
    shutil.copytree(src, out)
    for shard in out.glob("*.safetensors"):
        save_file(adapter.to_layout(None, load_file(shard), layout), shard, metadata={"format": "pt"})
    return out
