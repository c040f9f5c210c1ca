"""Qwen2.5-Omni's 3-D RoPE positions of one document: the thinker's own `get_rope_index` (audio spans
included), run without building the model (spindle.models.shared.vlm_rope.thinker_rope_for)."""

from __future__ import annotations

from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniPreTrainedModelForConditionalGeneration

from spindle.models.shared.vlm_rope import thinker_rope_for

rope_index = thinker_rope_for(Qwen2_5OmniPreTrainedModelForConditionalGeneration)
