"""GPT-OSS expert tensors in, bf16 expert tensors out: the family's checkpoint adapter
(spindle.contracts.family.CheckpointAdapter). Its experts are fused as no other family's: per MoE layer
(every layer) `mlp.experts.gate_up_proj [E, H, 2I]` (the gate and up columns interleaved: gate at even,
up at odd columns), `gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]` and `down_proj_bias [E, H]`, the model's
own layout, which transformers loads without a conversion mapping. Two checkpoint layouts:

- fused (`FUSED`): those four tensors as the model holds them, bf16 or fp32 (what stock `save_pretrained`
  writes; a tiny model's);
- MXFP4 (`MXFP4`: openai/gpt-oss-20b and -120b as released): each weight as `{name}_blocks [E, R, C/32, 16]`
  (uint8, two 4-bit values a byte, 32 values a block) and `{name}_scales [E, R, C/32]` (uint8 power-of-two
  exponents, biased by 127), of the weight transposed (R the output rows), biases in bf16; config.json carries
  `quantization_config: {"quant_method": "mxfp4"}`.

MXFP4 is dequantised on load to the training dtype (transformers' own `convert_moe_packed_tensors`, the
function its quantizer dequantises with; exact, as every MXFP4 value is a bf16 value), because the experts
train in full precision: gradients and optimizer updates of 4-bit weights would be lost to the rounding, and
a LoRA on them would need the dequantised weights anyway. The export writes the fused layout in
`export.dtype` (bf16 by default) with no quantization_config: re-quantising trained weights to MXFP4 is a
lossy step transformers does only with its triton kernels on a GPU (`Mxfp4Quantize`), a choice the user
makes after training rather than one an export makes silently. A missing, unrecognised or misshapen expert
tensor is an error naming the key before anything loads (a tensor left random would train silently).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spindle.models.shared.moe_checkpoints import (
    ExpertCheckpointError,
    ExpertCheckpoints,
    expert_count,
    expert_intermediate_size,
    moe_config,
    moe_layers,
    read_tensor_shapes,
)

FUSED = "fused"
MXFP4 = "mxfp4"
LAYOUTS = (FUSED, MXFP4)
WEIGHTS = ("gate_up_proj", "down_proj")
_EXPERT_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<rest>[a-z_]+)$")
MXFP4_BLOCK = 32  # values per block (one scale each), 2 a byte: 16 bytes a block


@dataclass(frozen=True)
class GptOssExpertCheckpoints:
    """GPT-OSS's `CheckpointAdapter` (module docstring)."""

    default_layout: str = FUSED
    layers_prefix: str = "model.layers"

    @staticmethod
    def expected_expert_tensors(config: Any, layout: str) -> dict[str, tuple[int, ...]]:
        """{name after `experts.`: shape} of one MoE layer's tensors in `layout`."""
        c = moe_config(config)
        e, h, i = expert_count(config), c.hidden_size, expert_intermediate_size(config)
        biases = {"gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
        if layout == FUSED:
            return {"gate_up_proj": (e, h, 2 * i), "down_proj": (e, i, h), **biases}
        blocks = MXFP4_BLOCK // 2
        return {
            "gate_up_proj_blocks": (e, 2 * i, h // MXFP4_BLOCK, blocks),
            "gate_up_proj_scales": (e, 2 * i, h // MXFP4_BLOCK),
            "down_proj_blocks": (e, h, i // MXFP4_BLOCK, blocks),
            "down_proj_scales": (e, h, i // MXFP4_BLOCK),
            **biases,
        }

    def check_expert_tensors(self, shapes: dict[str, tuple[int, ...]], config: Any, where: str = "checkpoint") -> str:
        """Validate every MoE layer's expert tensors; -> the checkpoint's layout (FUSED or MXFP4). Raises
        ExpertCheckpointError naming the key of an unrecognised, misshapen or missing tensor."""
        by_layer: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
        for key, shape in shapes.items():
            if m := _EXPERT_KEY.match(key):
                by_layer.setdefault(int(m.group("layer")), {})[m.group("rest")] = (key, shape)
        layouts = set()
        for layer in moe_layers(config):
            found = by_layer.pop(layer, {})
            layout = MXFP4 if any(rest.endswith("_blocks") for rest in found) else FUSED
            expected = self.expected_expert_tensors(config, layout)
            for rest, (key, shape) in sorted(found.items()):
                if rest not in expected:
                    raise ExpertCheckpointError(
                        f"{where}: unrecognised expert tensor {key} {list(shape)} in a {layout} layer "
                        f"(expected {', '.join(expected)})"
                    )
                if shape != expected[rest]:
                    raise ExpertCheckpointError(
                        f"{where}: expert tensor {key} has shape {list(shape)}, expected {list(expected[rest])} "
                        f"(hidden_size={moe_config(config).hidden_size}, intermediate_size="
                        f"{expert_intermediate_size(config)}, num_local_experts={expert_count(config)}); the "
                        "checkpoint does not match its config.json"
                    )
            if missing := [rest for rest in expected if rest not in found]:
                raise ExpertCheckpointError(
                    f"{where}: expert tensor {self.layers_prefix}.{layer}.mlp.experts.{missing[0]} is missing"
                    + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                    + f"; a {layout} MoE layer needs {', '.join(expected)}. Loading would leave it random"
                )
            layouts.add(layout)
        if len(layouts) > 1:
            raise ExpertCheckpointError(f"{where}: MoE layers mix the expert layouts {sorted(layouts)}")
        return layouts.pop() if layouts else self.default_layout

    def layout(self, folder: str | Path) -> str:
        """The validated expert layout of a transformers checkpoint folder (headers only)."""
        from transformers import AutoConfig

        return self.check_expert_tensors(read_tensor_shapes(folder), AutoConfig.from_pretrained(folder), str(folder))

    @contextlib.contextmanager
    def loading(self, layout: str) -> Iterator[None]:
        """Nothing to install: the fused layout is the model's; MXFP4 is dequantised by transformers'
        quantizer (`load_kwargs`) on the full load and by `load_sources` on the sharded one."""
        yield

    def load_kwargs(self, layout: str) -> dict[str, Any]:
        """`from_pretrained` arguments for a checkpoint in `layout`: MXFP4 dequantised by transformers'
        quantizer (`Mxfp4Config(dequantize=True)`) into the parameters' dtype."""
        if layout != MXFP4:
            return {}
        from transformers import Mxfp4Config

        return {"quantization_config": Mxfp4Config(dequantize=True)}

    check_loading_info = staticmethod(ExpertCheckpoints.check_loading_info)

    def to_layout(self, model: Any, state_dict: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
        """The trained tensors as the export writes them: the fused layout whatever the input's (an MXFP4
        input is exported dequantised: module docstring)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown GPT-OSS expert layout {layout!r}; one of {LAYOUTS}")
        return state_dict

    def load_sources(self, sources: dict[str, Any]) -> dict[str, Any]:
        """Sharded loading: each MXFP4 `{name}_blocks` / `{name}_scales` pair read as the model's `{name}`
        ([E, H, 2I] / [E, I, H]), a region dequantising only the experts it covers; fused tensors pass through."""
        out = dict(sources)
        for key in sources:
            m = _EXPERT_KEY.match(key)
            if not m or not m.group("rest").endswith("_blocks"):
                continue
            name = m.group("rest").removesuffix("_blocks")
            blocks, scales = out.pop(key), out.pop(f"{m.group('prefix')}.{name}_scales")
            experts, rows, groups, _ = blocks[0]
            out[f"{m.group('prefix')}.{name}"] = ((experts, groups * MXFP4_BLOCK, rows), _dequantised(blocks, scales))
        return out


def _dequantised(blocks: Any, scales: Any) -> Any:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    def read(region: tuple[slice, ...]) -> torch.Tensor:
        experts, cols, rows = region
        whole = tuple(slice(0, n) for n in blocks[0][1:])
        weight = convert_moe_packed_tensors(
            blocks[1]((experts, *whole)), scales[1]((experts, *whole[:-1])), dtype=torch.float32
        )
        return weight[:, cols, rows]

    return read


ADAPTER = GptOssExpertCheckpoints()
