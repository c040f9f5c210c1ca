"""Qwen3-Omni-MoE's 3-D RoPE positions of one document: the thinker's own `get_rope_index` (audio spans and
audio-in-video interleaving included), run without building the model."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration,
)

from spindle.models.shared.vlm_rope import thinker_rope_for

# Qwen2.5-Omni's method names, its audio token counts following the audio encoder's `n_window` chunks
rope_index = thinker_rope_for(Qwen3OmniMoePreTrainedModelForConditionalGeneration)


def audio_tokens(config: Any, frames: int) -> int:
    """How many decoder tokens the audio encoder makes of `frames` mel frames (13 per full `n_window * 2`-frame
    chunk, the rest through its three stride-2 convolutions): the model's `_get_feat_extract_output_lengths`."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), config.audio_config.n_window))
