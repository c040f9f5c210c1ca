"""FLUX.2 LoRA keys in the original (BFL) model layout, as kohya / ComfyUI name them (`lora_unet_double_blocks_0_
img_attn_qkv`), read back by diffusers' `_convert_kohya_flux2_lora_to_diffusers` (through `Flux2Pipeline.
lora_state_dict`). Written by Flux's writer (`spindle.models.flux.lora.fused_to_kohya`) with FLUX.2's tables: BFL
fuses the double blocks' q, k, v (their adapters become one, downs stacked and ups block-diagonal: the same
update, which the reader splits back); the single blocks' fused projections are single modules in diffusers too.
"""

from __future__ import annotations

import torch

from spindle.models.flux.lora import Groups, fused_to_kohya

# diffusers module inside a block -> (BFL module, parts fused into it)
_DOUBLE: dict[str, tuple[str, ...]] = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": ("attn.to_out.0",),
    "img_mlp_0": ("ff.linear_in",),
    "img_mlp_2": ("ff.linear_out",),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": ("attn.to_add_out",),
    "txt_mlp_0": ("ff_context.linear_in",),
    "txt_mlp_2": ("ff_context.linear_out",),
}
_SINGLE: dict[str, tuple[str, ...]] = {"linear1": ("attn.to_qkv_mlp_proj",), "linear2": ("attn.to_out",)}
_GROUPS: Groups = {
    "transformer_blocks": ("double_blocks", _DOUBLE),
    "single_transformer_blocks": ("single_blocks", _SINGLE),
}


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers-layout LoRA (no "transformer." prefix) -> kohya/BFL layout (`lora_unet_...`)."""
    return fused_to_kohya(state_dict, _GROUPS, "FLUX.2")
