"""Fused-experts checkpoints in, the input's layout out, with nothing silently random: the checkpoint
adapter (spindle.contracts.family.CheckpointAdapter) of the MoE families whose transformers modeling
holds each MoE layer's experts as two stacked parameters, `gate_up_proj [E, 2I, H]` (gate rows, then
up rows) and `down_proj [E, H, I]` (Qwen3-MoE, Qwen3-VL-MoE).

A layer's experts (prefix `...layers.{l}.mlp.experts.`) come in two checkpoint layouts:

- per-expert (Qwen3-MoE's released checkpoints, what its stock `save_pretrained` writes, what serving
  engines and FP8 checkpoints use): `{j}.gate_proj.weight [I, H]`, `{j}.up_proj.weight [I, H]`,
  `{j}.down_proj.weight [H, I]`, j < E;
- fused: `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` as the model holds them (what transformers
  5.23's `save_pretrained` of Qwen3-VL-MoE writes);
- fused transposed: `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]` (Qwen3-VL-MoE's released
  checkpoints; transformers transposes them on load where a shape differs from the model's). Accepted
  where the family says so (`ExpertCheckpoints.transposed_fused`). A layer's two tensors tell the two
  fused orientations apart even where one tensor is square (2I == H or I == H); transformers decides per
  tensor, so a square tensor of a transposed checkpoint loads untransposed through `from_pretrained`
  (Spindle's sharded load reads it right).

transformers loads what its conversion mapping knows, but a missing expert or a tensor of another shape
ends as a "missing/mismatched key" warning and a randomly initialised parameter (a first-step loss of
17 instead of 2.8). `layout` reads the safetensors headers before loading and raises naming the key;
the export writes the layout the input had (`to_layout`); `load_sources` reads either layout straight
into the fused parameters, region by region (a rank holding E/ep experts reads their bytes only).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PER_EXPERT = "per_expert"
FUSED = "fused"
FUSED_TRANSPOSED = "fused_transposed"
LAYOUTS = (PER_EXPERT, FUSED, FUSED_TRANSPOSED)
FUSED_KEYS = ("gate_up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<rest>.+)$")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

Region = tuple[slice, ...]
Source = tuple[tuple[int, ...], Callable[[Region], torch.Tensor]]


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


def moe_config(config: Any) -> Any:
    """The config that holds the MoE fields: a VLM's text config, a causal LM's own."""
    return config.get_text_config()


def expert_count(config: Any) -> int:
    """The routed experts per MoE layer: `num_experts` (Qwen's MoE configs), else `num_local_experts`
    (DeepSeek-V3's maps it to `n_routed_experts`; Qwen3-Omni-MoE's text config has only `num_experts`)."""
    c = moe_config(config)
    count: int = c.num_experts if hasattr(c, "num_experts") else c.num_local_experts
    return count


def expert_intermediate_size(config: Any) -> int:
    """One expert's intermediate size: `moe_intermediate_size` (Qwen's and DeepSeek's MoE configs, whose
    `intermediate_size` is the dense MLP's), else `intermediate_size` (GPT-OSS: every layer a MoE)."""
    c = moe_config(config)
    size: int = c.moe_intermediate_size if hasattr(c, "moe_intermediate_size") else c.intermediate_size
    return size


def moe_layers(config: Any) -> list[int]:
    """Indices of the sparse (MoE) decoder layers, by transformers' own rule: DeepSeek-V3's
    (DeepseekV3DecoderLayer: every layer from `first_k_dense_replace` on), Qwen3-MoE's
    (Qwen3MoeDecoderLayer: `decoder_sparse_step`, minus `mlp_only_layers`), else every layer (GptOssDecoderLayer)."""
    c = moe_config(config)
    if hasattr(c, "first_k_dense_replace"):
        return list(range(c.first_k_dense_replace, c.num_hidden_layers))
    if not hasattr(c, "decoder_sparse_step"):
        return list(range(c.num_hidden_layers))
    return [
        i
        for i in range(c.num_hidden_layers)
        if i not in (c.mlp_only_layers or []) and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0
    ]


@dataclass(frozen=True)
class ExpertCheckpoints:
    """A family's `CheckpointAdapter` for fused experts (module docstring)."""

    model_type: str  # transformers' model type (the conversion mapping registered for the patched class)
    default_layout: str = PER_EXPERT  # what a checkpoint of the family is written in from scratch
    transposed_fused: bool = False  # the family's checkpoints may hold fused tensors transposed
    layers_prefix: str = "model.layers"  # where the decoder layers are (named in a missing-tensor error)
    # the checkpoint keys of the trained model ("thinker." of an omni folder): other sub-models' experts (its
    # talker's, of other shapes) are not checked
    key_prefix: str = ""
    # more model types to register while loading: a sub-model whose own mapping converts the experts where
    # the root's class-name mapping only renames (Qwen3-Omni-MoE's thinker: its text model's)
    sub_model_types: tuple[str, ...] = ()

    # ------------------------------------------------------------ checks before loading

    @staticmethod
    def expected_expert_tensors(config: Any, layout: str) -> dict[str, tuple[int, ...]]:
        """{suffix after `experts.`: shape} of one MoE layer in `layout`."""
        c = moe_config(config)
        e, h, i = expert_count(config), c.hidden_size, c.moe_intermediate_size
        if layout == FUSED:
            return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
        if layout == FUSED_TRANSPOSED:
            return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h)}
        out: dict[str, tuple[int, ...]] = {}
        for j in range(expert_count(config)):
            out.update(
                {f"{j}.gate_proj.weight": (i, h), f"{j}.up_proj.weight": (i, h), f"{j}.down_proj.weight": (h, i)}
            )
        return out

    def check_expert_tensors(self, shapes: dict[str, tuple[int, ...]], config: Any, where: str = "checkpoint") -> str:
        """Validate every MoE layer's expert tensors; -> the checkpoint's layout (PER_EXPERT or FUSED).

        Raises ExpertCheckpointError naming the key for an unrecognised expert tensor, a wrong shape, a
        missing expert, or a layer mixing the two layouts.
        """
        c = moe_config(config)
        by_layer: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        for key, shape in shapes.items():
            m = _EXPERT_KEY.match(key)
            if m:
                by_layer.setdefault(int(m.group("layer")), {})[m.group("rest")] = (key, shape)
        layouts = set()
        for layer in moe_layers(config):
            found = by_layer.pop(layer, {})
            layout = self._layer_layout({rest: shape for rest, (_, shape) in found.items()}, config)
            expected = self.expected_expert_tensors(config, layout)
            for rest, (key, shape) in sorted(found.items()):
                if rest not in expected:
                    hint = (
                        "fused keys are gate_up_proj/down_proj"
                        if layout == FUSED
                        else f"experts are 0..{expert_count(config) - 1}"
                    )
                    raise ExpertCheckpointError(
                        f"{where}: unrecognised expert tensor {key} {list(shape)} in a {layout} layer "
                        f"(num_experts={expert_count(config)}; {hint})"
                    )
                if shape != expected[rest]:
                    raise ExpertCheckpointError(
                        f"{where}: expert tensor {key} has shape {list(shape)}, expected {list(expected[rest])} "
                        f"(hidden_size={c.hidden_size}, moe_intermediate_size={c.moe_intermediate_size}, "
                        f"num_experts={expert_count(config)}); the checkpoint does not match its config.json"
                    )
            missing = [r for r in expected if r not in found]
            if missing:
                prefix = (
                    next(iter(found.values()))[0].rsplit(".experts.", 1)[0]
                    if found
                    else f"{self.layers_prefix}.{layer}.mlp"
                )
                raise ExpertCheckpointError(
                    f"{where}: expert tensor {prefix}.experts.{missing[0]} is missing"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + f"; a {layout} MoE layer needs {len(expected)} expert tensors. Loading would leave it random"
                )
            layouts.add(layout)
        if by_layer:
            layer = min(by_layer)
            key = next(iter(by_layer[layer].values()))[0]
            raise ExpertCheckpointError(
                f"{where}: expert tensor {key} belongs to layer {layer}, which is not a MoE layer"
            )
        if len(layouts) > 1:
            raise ExpertCheckpointError(f"{where}: MoE layers mix the expert layouts {sorted(layouts)}")
        return layouts.pop() if layouts else self.default_layout

    def _layer_layout(self, shapes: dict[str, tuple[int, ...]], config: Any) -> str:
        if not any(k in shapes for k in FUSED_KEYS):
            return PER_EXPERT
        transposed = self.expected_expert_tensors(config, FUSED_TRANSPOSED)
        if self.transposed_fused and all(shapes.get(k) == v for k, v in transposed.items()):
            return FUSED_TRANSPOSED  # both tensors transposed (never true of the model's orientation too)
        return FUSED

    def layout(self, folder: str | Path) -> str:
        """The validated expert layout of a transformers checkpoint folder."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        shapes = {k: v for k, v in read_tensor_shapes(folder).items() if k.startswith(self.key_prefix)}
        return self.check_expert_tensors(shapes, config, where=str(folder))

    # ------------------------------------------------------------ transformers' load path

    @contextlib.contextmanager
    def loading(self, layout: str) -> Iterator[None]:
        """Within the block, transformers' `from_pretrained` of the family's patched class converts a
        checkpoint in `layout`; afterwards transformers' mappings are as they were.

        transformers skips the conversion mapping of any model class defined outside its own package
        ("custom code", `PreTrainedModel.is_custom_code`), which a patchgen-generated class is: without a
        registration, a per-expert checkpoint loads with every expert MISSING (randomly initialised), a
        transposed fused one with every expert mismatched. Registering a mapping for the model type marks
        it user-registered, which lifts the skip. The mapping is transformers' own for the model type,
        except where it has none for `layout` (Qwen3-VL-MoE's has only the transposition of its fused
        layout): then qwen2_moe's per-expert recipe (`experts.*.{gate,up}_proj` stacked into
        `gate_up_proj`, `experts.*.down_proj` into `down_proj`). Scoped, because the registration is
        process-wide and keyed by model type: stock transformers' loads of the same model type (a test's
        reference model, an export) must keep transformers' own mapping.
        """
        with contextlib.ExitStack() as stack:
            for model_type in (self.model_type, *self.sub_model_types):
                stack.enter_context(_registered(model_type, layout))
            yield

    @staticmethod
    def load_kwargs(layout: str) -> dict[str, Any]:
        """No extra `from_pretrained` arguments: the loading context converts every layout."""
        return {}

    @staticmethod
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

    # ------------------------------------------------------------ export

    def to_layout(self, model: Any, state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
        """The model's fused expert tensors (plain tensors, model names) in the checkpoint's `layout`:
        FUSED as they are, FUSED_TRANSPOSED transposed, PER_EXPERT split per expert (the inverse of
        `load_sources`, which the round-trip tests check against the input bytes)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown expert layout {layout!r}; one of {LAYOUTS}")
        if layout == FUSED:
            return state_dict
        out: dict[str, torch.Tensor] = {}
        for key, value in state_dict.items():
            m = _EXPERT_KEY.match(key)
            rest = m.group("rest") if m else ""
            if rest not in FUSED_KEYS:
                out[key] = value
            elif layout == FUSED_TRANSPOSED:
                out[key] = value.transpose(1, 2).contiguous()
            else:
                prefix = m.group("prefix") if m else ""
                if rest == "gate_up_proj":
                    inter = value.shape[1] // 2
                    for j in range(value.shape[0]):
                        out[f"{prefix}.{j}.gate_proj.weight"] = value[j, :inter].contiguous()
                        out[f"{prefix}.{j}.up_proj.weight"] = value[j, inter:].contiguous()
                else:
                    for j in range(value.shape[0]):
                        out[f"{prefix}.{j}.down_proj.weight"] = value[j].contiguous()
        return out

    # ------------------------------------------------------------ sharded loading

    def load_sources(self, sources: dict[str, Source]) -> dict[str, Source]:
        """Sharded loading (spindle.distributed.sharded_load): per-expert tensors read as the fused
        `gate_up_proj [E, 2I, H]` (gate rows then up rows, transformers' load-time mapping) and
        `down_proj [E, H, I]`, a layer's transposed fused tensors read transposed. A region reads only the
        experts and rows it covers, one expert at a time. Fused tensors in the model's orientation pass through."""
        out: dict[str, Source] = {}
        per_expert: dict[str, dict[int, dict[str, Source]]] = {}
        fused: dict[str, dict[str, Source]] = {}
        for key, source in sources.items():
            m = _EXPERT_KEY.match(key)
            rest = m.group("rest").split(".") if m else []
            if m and len(rest) == 3 and rest[0].isdigit() and rest[1] in PROJECTIONS and rest[2] == "weight":
                per_expert.setdefault(m.group("prefix"), {}).setdefault(int(rest[0]), {})[rest[1]] = source
            elif m and rest[0] in FUSED_KEYS and len(rest) == 1:
                fused.setdefault(m.group("prefix"), {})[rest[0]] = source
            out[key] = source
        for prefix, pair in fused.items():
            if self.transposed_fused and _transposed_pair(pair):
                out.update({f"{prefix}.{k}": _transposed(v) for k, v in pair.items()})
        for prefix, experts in per_expert.items():
            count = len(experts)
            gate = [experts[j]["gate_proj"] for j in range(count)]
            up = [experts[j]["up_proj"] for j in range(count)]
            down = [experts[j]["down_proj"] for j in range(count)]
            inter, hidden = gate[0][0]
            out[f"{prefix}.gate_up_proj"] = ((count, 2 * inter, hidden), _fused_gate_up(gate, up, inter))
            out[f"{prefix}.down_proj"] = ((count, *down[0][0]), _stacked(down))
            for j in range(count):
                for name in PROJECTIONS:
                    del out[f"{prefix}.{j}.{name}.weight"]
        return out


@contextlib.contextmanager
def _registered(model_type: str, layout: str) -> Iterator[None]:
    """`ExpertCheckpoints.loading` for one model type: its mapping registered, then restored."""
    from transformers import conversion_mapping as cm

    original = cm._build_checkpoint_conversion_mapping().get(model_type) or []
    mapping = original
    if layout == PER_EXPERT and not any(_reads_per_expert(c) for c in original):
        mapping = cm.get_checkpoint_conversion_mapping("qwen2_moe")
    registered = model_type in cm.USER_REGISTERED_MAPPINGS
    before = cm.get_checkpoint_conversion_mapping(model_type)
    cm.register_checkpoint_conversion_mapping(model_type, mapping, overwrite=True)
    try:
        yield
    finally:
        cm.register_checkpoint_conversion_mapping(model_type, before or original, overwrite=True)
        if not registered:
            cm.USER_REGISTERED_MAPPINGS.discard(model_type)


def _reads_per_expert(converter: Any) -> bool:
    """Whether a transformers conversion rule takes per-expert tensors (`experts.*.` source patterns)."""
    patterns = getattr(converter, "source_patterns", ()) or ()
    return any("experts.*." in str(p) for p in ([patterns] if isinstance(patterns, str) else patterns))


def _transposed_pair(pair: dict[str, Source]) -> bool:
    """Whether a layer's fused tensors are transposed: `gate_up [E, H, 2I]` with `down [E, I, H]` (the
    model's `[E, 2I, H]` with `[E, H, I]` would need H == 0 to match as well)."""
    if set(pair) != set(FUSED_KEYS):
        return False
    (_, x, y), (_, z, w) = pair["gate_up_proj"][0], pair["down_proj"][0]
    return x == w and y == 2 * z


def _transposed(source: Source) -> Source:
    (experts, a, b), read = source[0], source[1]

    def read_t(region: Region) -> torch.Tensor:
        e, rows, cols = region
        return read((e, cols, rows)).transpose(1, 2)

    return (experts, b, a), read_t


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
