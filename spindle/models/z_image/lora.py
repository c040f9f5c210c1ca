"""Z-Image LoRA keys in the original (Tongyi Z-Image) model layout, as kohya-style trainers and ComfyUI name them
(`lora_unet_layers_0_attention_qkv`), read back by diffusers' `_convert_non_diffusers_z_image_lora_to_diffusers`
(through `ZImagePipeline.lora_state_dict`). Written by Flux's kohya writer (`spindle.models.flux.lora.
fused_to_kohya`) with Z-Image's table: the original attention fuses q, k, v into `qkv` (their adapters become one,
downs stacked and ups block-diagonal: the same update, which diffusers' reader splits back into to_q / to_k /
to_v) and names the output projection `out`; the feed-forward and modulation keep their names.
"""

from __future__ import annotations

import torch

from spindle.models.flux.lora import Groups, fused_to_kohya

# diffusers module inside a block -> (original module, parts fused into it); every block list has the same blocks
_BLOCK: dict[str, tuple[str, ...]] = {
    "attention_qkv": ("attention.to_q", "attention.to_k", "attention.to_v"),
    "attention_out": ("attention.to_out.0",),
    "feed_forward_w1": ("feed_forward.w1",),
    "feed_forward_w2": ("feed_forward.w2",),
    "feed_forward_w3": ("feed_forward.w3",),
    "adaLN_modulation_0": ("adaLN_modulation.0",),
}
_GROUPS: Groups = {name: (name, _BLOCK) for name in ("layers", "noise_refiner", "context_refiner")}


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers-layout LoRA (no "transformer." prefix) -> the kohya / original Z-Image layout (`lora_unet_...`)."""
    return fused_to_kohya(state_dict, _GROUPS, "Z-Image")
