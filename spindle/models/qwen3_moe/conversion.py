"""Qwen3-MoE expert tensors in, expert tensors out, with nothing silently random.

Two checkpoint layouts exist for a MoE layer's experts (prefix `model.layers.{l}.mlp.experts.`):

- per-expert (what Qwen's checkpoints and stock `save_pretrained` write, what serving engines read):
  `{j}.gate_proj.weight [I, H]`, `{j}.up_proj.weight [I, H]`, `{j}.down_proj.weight [H, I]`, j < E;
- fused (transformers' in-memory layout): `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`.

transformers loads both (its conversion mapping stacks per-expert tensors into the fused parameters),
but a missing expert or a tensor of another shape ends as a "missing/mismatched key" warning and a
randomly initialised parameter: a first-step loss of 17 instead of 2.8. `check_expert_tensors` reads
the safetensors headers before loading and raises naming the key; `expert_layout` tells the export
which layout the input had, and `to_layout` writes that layout back (per-expert through transformers'
own `revert_weight_conversion`, the inverse of its load-time mapping).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

MODEL_TYPE = "qwen3_moe"
PER_EXPERT = "per_expert"
FUSED = "fused"
LAYOUTS = (PER_EXPERT, FUSED)
_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<rest>.+)$")


class ExpertCheckpointError(ValueError):
    """An expert tensor is missing, unrecognised or of the wrong shape."""


def read_tensor_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """{key: shape} of every tensor of a safetensors checkpoint folder (headers only, no data read)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def moe_layers(config) -> list[int]:
    """Indices of the sparse (MoE) decoder layers, by transformers' own rule (Qwen3MoeDecoderLayer)."""
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
    ]


def expected_expert_tensors(config, layout: str) -> dict[str, tuple[int, ...]]:
    """{suffix after `experts.`: shape} of one MoE layer in `layout`."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    if layout == FUSED:
        return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
    out: dict[str, tuple[int, ...]] = {}
    for j in range(e):
        out.update({f"{j}.gate_proj.weight": (i, h), f"{j}.up_proj.weight": (i, h), f"{j}.down_proj.weight": (h, i)})
    return out


def check_expert_tensors(shapes: dict[str, tuple[int, ...]], config, where: str = "checkpoint") -> str:
    """Validate every MoE layer's expert tensors; -> the checkpoint's layout (PER_EXPERT or FUSED).

    Raises ExpertCheckpointError naming the key for an unrecognised expert tensor, a wrong shape, a
    missing expert, or a layer mixing the two layouts.
    """
    by_layer: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for key, shape in shapes.items():
        m = _EXPERT_KEY.match(key)
        if m:
            by_layer.setdefault(int(m.group("layer")), {})[m.group("rest")] = (key, shape)
    layouts = set()
    for layer in moe_layers(config):
        found = by_layer.pop(layer, {})
        layout = FUSED if "gate_up_proj" in found else PER_EXPERT
        expected = expected_expert_tensors(config, layout)
        for rest, (key, shape) in sorted(found.items()):
            if rest not in expected:
                hint = (
                    "fused keys are gate_up_proj/down_proj"
                    if layout == FUSED
                    else f"experts are 0..{config.num_experts - 1}"
                )
                raise ExpertCheckpointError(
                    f"{where}: unrecognised expert tensor {key} {list(shape)} in a {layout} layer "
                    f"(num_experts={config.num_experts}; {hint})"
                )
            if shape != expected[rest]:
                raise ExpertCheckpointError(
                    f"{where}: expert tensor {key} has shape {list(shape)}, expected {list(expected[rest])} "
                    f"(hidden_size={config.hidden_size}, moe_intermediate_size={config.moe_intermediate_size}, "
                    f"num_experts={config.num_experts}); the checkpoint does not match its config.json"
                )
        missing = [r for r in expected if r not in found]
        if missing:
            prefix = next(iter(found.values()))[0].rsplit(".experts.", 1)[0] if found else f"model.layers.{layer}.mlp"
            raise ExpertCheckpointError(
                f"{where}: expert tensor {prefix}.experts.{missing[0]} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + f"; a {layout} MoE layer needs {len(expected)} expert tensors. Loading would leave it random"
            )
        layouts.add(layout)
    if by_layer:
        layer = min(by_layer)
        key = next(iter(by_layer[layer].values()))[0]
        raise ExpertCheckpointError(f"{where}: expert tensor {key} belongs to layer {layer}, which is not a MoE layer")
    if len(layouts) > 1:
        raise ExpertCheckpointError(f"{where}: MoE layers mix the per-expert and fused expert layouts")
    return layouts.pop() if layouts else PER_EXPERT


def expert_layout(folder: str | Path) -> str:
    """The validated expert layout of a transformers checkpoint folder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    return check_expert_tensors(read_tensor_shapes(folder), config, where=str(folder))


def register_conversion() -> None:
    """Make transformers apply its Qwen3-MoE checkpoint conversion to Spindle's patched class too.

    transformers skips the conversion mapping of any model class defined outside its own package
    ("custom code", `PreTrainedModel.is_custom_code`), which the patchgen-generated
    `Qwen3MoeForCausalLM` is: without this, a per-expert checkpoint loads with every expert MISSING
    (randomly initialised) and every per-expert tensor UNEXPECTED. Registering transformers' own
    mapping for "qwen3_moe" (unchanged) marks it user-registered, which lifts the skip.
    """
    from transformers import conversion_mapping as cm

    if MODEL_TYPE not in cm.USER_REGISTERED_MAPPINGS:
        cm.register_checkpoint_conversion_mapping(
            MODEL_TYPE, cm.get_checkpoint_conversion_mapping(MODEL_TYPE), overwrite=True
        )


def check_loading_info(info: dict, where: str) -> None:
    """After `from_pretrained(..., output_loading_info=True)`: any missing, unexpected or mismatched key
    is an error naming it (a missing key would be a randomly initialised parameter)."""
    for kind in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        keys = sorted(str(k) for k in info.get(kind) or ())
        if keys:
            raise ExpertCheckpointError(
                f"{where}: loading left {kind.replace('_', ' ')}: {', '.join(keys[:5])}"
                + (f" (and {len(keys) - 5} more)" if len(keys) > 5 else "")
            )


def to_layout(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The model's (fused) state dict in `layout`: FUSED as it is, PER_EXPERT through transformers'
    `revert_weight_conversion` (what `save_pretrained` writes). Expert tensors must be plain tensors."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown expert layout {layout!r}; one of {LAYOUTS}")
    if layout == FUSED:
        return state_dict
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


Region = tuple[slice, ...]
Source = tuple[tuple[int, ...], Callable[[Region], torch.Tensor]]


def load_sources(sources: dict[str, Source]) -> dict[str, Source]:
    """Sharded loading (spindle.distributed.sharded_load): per-expert tensors read as the fused
    `gate_up_proj [E, 2I, H]` (gate rows then up rows, transformers' load-time mapping) and
    `down_proj [E, H, I]`. A region reads only the experts and rows it covers, one expert at a time,
    so a rank holding E/ep experts reads those experts' bytes only. Fused checkpoints pass through."""
    out: dict[str, Source] = {}
    per_expert: dict[str, dict[int, dict[str, Source]]] = {}
    for key, source in sources.items():
        m = _EXPERT_KEY.match(key)
        rest = m.group("rest").split(".") if m else []
        if m and len(rest) == 3 and rest[0].isdigit() and rest[2] == "weight":
            per_expert.setdefault(m.group("prefix"), {}).setdefault(int(rest[0]), {})[rest[1]] = source
        else:
            out[key] = source
    for prefix, experts in per_expert.items():
        count = len(experts)
        gate = [experts[j]["gate_proj"] for j in range(count)]
        up = [experts[j]["up_proj"] for j in range(count)]
        down = [experts[j]["down_proj"] for j in range(count)]
        inter, hidden = gate[0][0]
        out[f"{prefix}.gate_up_proj"] = ((count, 2 * inter, hidden), _fused_gate_up(gate, up, inter))
        out[f"{prefix}.down_proj"] = ((count, *down[0][0]), _stacked(down))
    return out


def _stacked(parts: list[Source]) -> Callable[[Region], torch.Tensor]:
    def read(region: Region) -> torch.Tensor:
        experts, rest = region[0], region[1:]
        return torch.stack([parts[j][1](rest) for j in range(experts.start, experts.stop)])

    return read


def _fused_gate_up(gate: list[Source], up: list[Source], inter: int) -> Callable[[Region], torch.Tensor]:
    def read(region: Region) -> torch.Tensor:
        experts, rows, cols = region
        pieces = []
        for j in range(experts.start, experts.stop):
            parts = []
            if rows.start < inter:  # gate rows
                parts.append(gate[j][1]((slice(rows.start, min(rows.stop, inter)), cols)))
            if rows.stop > inter:  # up rows
                parts.append(up[j][1]((slice(max(rows.start - inter, 0), rows.stop - inter), cols)))
            pieces.append(torch.cat(parts))
        return torch.stack(pieces)

    return read


class Qwen3MoeCheckpoints:
    """The family's `CheckpointAdapter` (spindle.contracts.family): the functions above, as the MoE task
    reaches them through `FAMILY.adapter()`."""

    default_layout = PER_EXPERT
    layout = staticmethod(expert_layout)
    register = staticmethod(register_conversion)
    check_loading_info = staticmethod(check_loading_info)
    to_layout = staticmethod(to_layout)
    load_sources = staticmethod(load_sources)


ADAPTER = Qwen3MoeCheckpoints()
