"""Wan LoRA keys in the original Wan layout (what ComfyUI and the Wan2.1 code use).

diffusers names (`blocks.N.attn1.to_q`) <-> original names (`diffusion_model.blocks.N.self_attn.q`),
with `lora_A`/`lora_B` kept: the layout diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`
reads (through `WanPipeline.lora_state_dict`), so `spindle`'s export is checked against diffusers'
own reader. The alpha / rank scale is already folded into `lora_B` (see `spindle.train.lora`), so no
`.alpha` keys are written (readers then take alpha = rank, a scale of 1).
"""

from __future__ import annotations

import re

import torch

PREFIX = "diffusion_model."
# diffusers module inside a block -> original module
_BLOCK = {
    "attn1.to_q": "self_attn.q",
    "attn1.to_k": "self_attn.k",
    "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q",
    "attn2.to_k": "cross_attn.k",
    "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img",
    "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}
_KEY = re.compile(r"^blocks\.(\d+)\.(.+)\.(lora_[AB]\.weight)$")


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers-layout LoRA (`blocks.0.attn1.to_q.lora_A.weight`, no "transformer." prefix) -> Wan layout."""
    out = {}
    for key, value in state_dict.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in _BLOCK:
            raise ValueError(
                f"LoRA key {key!r} has no place in the original Wan layout (it covers {', '.join(_BLOCK)} inside "
                f"blocks); train with train.lora.targets among those to export a ComfyUI file"
            )
        out[f"{PREFIX}blocks.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"] = value
    return out
