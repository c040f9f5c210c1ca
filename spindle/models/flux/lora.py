"""Flux LoRA keys in the original (BFL) model layout, as kohya / sd-scripts name them.

That is the file ComfyUI, Forge and the BFL-based trainers load (`lora_unet_double_blocks_0_img_attn_qkv`),
and the one diffusers reads back with `_convert_kohya_flux_lora_to_diffusers` (through
`FluxPipeline.lora_state_dict`). BFL fuses projections diffusers keeps apart (q, k, v -> `qkv`;
q, k, v, mlp-in -> a single block's `linear1`): their adapters are written as one adapter of rank
n x r with the down matrices stacked and the up matrices block-diagonal, which is exactly the same
update, and which diffusers' reader recognises as such and splits back into the separate adapters.
The alpha / rank scale is already folded into `lora_B` (see `spindle.train.lora`), so each `.alpha`
equals the rank (a scale of 1).
"""

from __future__ import annotations

import re

import torch

# diffusers module inside a double block -> (BFL module, parts fused into it)
_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.net.0.proj",),
    "img_mlp_2": ("ff.net.2",),
    "img_mod_lin": ("norm1.linear",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.net.0.proj",),
    "txt_mlp_2": ("ff_context.net.2",),
    "txt_mod_lin": ("norm1_context.linear",),
}
_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": ("proj_out",),
    "modulation_lin": ("norm.linear",),
}
# diffusers block list -> (BFL block list, its modules' table)
Groups = dict[str, tuple[str, dict[str, tuple[str, ...]]]]
_GROUPS: Groups = {
    "transformer_blocks": ("double_blocks", _DOUBLE),
    "single_transformer_blocks": ("single_blocks", _SINGLE),
}


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers-layout LoRA (no "transformer." prefix) -> kohya/BFL layout (`lora_unet_...`)."""
    return fused_to_kohya(state_dict, _GROUPS, "Flux")


def fused_to_kohya(state_dict: dict[str, torch.Tensor], groups: Groups, label: str) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA of a transformer whose original code fuses projections diffusers keeps apart (BFL's
    FLUX.1 / FLUX.2, Z-Image) -> kohya keys (`lora_unet_<block list>_<i>_<name>`) by `groups`' tables; adapters of projections BFL fuses are written as one (stacked downs, block-diagonal ups),
    which diffusers' kohya readers (FLUX.1's, FLUX.2's, Z-Image's) split back into the same separate adapters."""
    pattern = re.compile(rf"^({'|'.join(map(re.escape, groups))})\.(\d+)\.(.+)\.lora_([AB])\.weight$")
    adapters: dict[tuple[str, str, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        m = pattern.match(key)
        if m is None:
            raise ValueError(
                f"LoRA key {key!r} has no place in the original {label} layout (only the transformer blocks' "
                f"projections map); train with train.lora.targets inside the blocks to export a ComfyUI file"
            )
        adapters.setdefault((m.group(1), m.group(2), m.group(3)), {})[m.group(4)] = value
    out: dict[str, torch.Tensor] = {}
    done: set[tuple[str, str, str]] = set()
    for (group, index, module), _ in sorted(adapters.items()):
        original, table = groups[group]
        fused = [(n, p) for n, p in table.items() if module in p]
        if not fused:
            raise ValueError(f"LoRA on {group}.{index}.{module} has no counterpart in the original {label} layout")
        name, parts = fused[0]
        keys = [(group, index, part) for part in parts]
        if keys[0] in done:
            continue
        missing = [k[2] for k in keys if k not in adapters]
        if missing:
            raise ValueError(
                f"original {label} layout fuses {', '.join(parts)} of {group}.{index} into {name}; the LoRA lacks "
                f"{', '.join(missing)} (adapt all of them, or none)"
            )
        downs = [adapters[k]["A"] for k in keys]
        ups = [adapters[k]["B"] for k in keys]
        prefix = f"lora_unet_{original}_{index}_{name}"
        out[f"{prefix}.lora_down.weight"] = torch.cat(downs).contiguous()
        out[f"{prefix}.lora_up.weight"] = torch.block_diag(*ups).contiguous()
        out[f"{prefix}.alpha"] = torch.tensor(float(sum(d.shape[0] for d in downs)))
        done.update(keys)
    return out
