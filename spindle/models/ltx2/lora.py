"""LTX-2 LoRA keys in the original Lightricks layout (what the LTX-2 trainer writes and ComfyUI loads):
`diffusion_model.` before the original module names (`patchify_proj`, `adaln_single`, `q_norm`, the audio-video
cross-attention's `av_ca_*` modulation ...), `lora_A` / `lora_B` kept. That is the layout diffusers'
`_convert_non_diffusers_ltx2_lora_to_diffusers` reads (through `LTX2Pipeline.lora_state_dict`), so the inverse
here is checked key by key against diffusers' own reader: a key the reader would not bring back to itself is
refused (the export then writes the diffusers file alone). The attention projections LoRA targets by default
(`attn1.to_q`, `audio_to_video_attn.to_out.0`, ...) keep their names in both layouts. As for every family, the
alpha / rank scale is folded into `lora_B` (spindle.train.lora), so no `.alpha` keys are written.
"""

from __future__ import annotations

import torch

PREFIX = "diffusion_model."
# diffusers name part -> original name part: the inverse of diffusers' table (LTX-2.3's prompt modulation included)
_RENAMES = (
    ("proj_in", "patchify_proj"),  # audio_proj_in -> audio_patchify_proj too
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video"),
    ("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio"),
    ("norm_q", "q_norm"),
    ("norm_k", "k_norm"),
    ("prompt_adaln", "prompt_adaln_single"),  # audio_prompt_adaln -> audio_prompt_adaln_single too
)
# top-level timestep embedders: diffusers prefix -> original prefix
_EMBEDDERS = (("audio_time_embed.", "audio_adaln_single."), ("time_embed.", "adaln_single."))


def _original_name(key: str) -> str:
    for diffusers, original in _EMBEDDERS:
        if key.startswith(diffusers):
            key = original + key.removeprefix(diffusers)
            break
    else:
        for diffusers, original in _RENAMES:
            key = key.replace(diffusers, original)
    return PREFIX + key


def to_original(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers-layout LoRA (`transformer_blocks.0.attn1.to_q.lora_A.weight`, no "transformer." prefix) -> the
    original LTX-2 layout; ValueError naming a key diffusers' reader would not map back to itself."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    out = {_original_name(key): value for key, value in state_dict.items()}
    back = _convert_non_diffusers_ltx2_lora_to_diffusers(out)
    for key, original in zip(state_dict, out, strict=True):
        if back.get(f"transformer.{key}") is not state_dict[key]:
            raise ValueError(
                f"LoRA key {key!r} has no place in the original LTX-2 layout ({original!r} reads back as another "
                "module in diffusers); train with train.lora.targets among the attention projections to export a "
                "ComfyUI file"
            )
    return out
