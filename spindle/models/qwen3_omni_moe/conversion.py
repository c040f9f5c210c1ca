"""Qwen3-Omni-MoE thinker expert tensors in, expert tensors out: the family's checkpoint adapter
(spindle/models/shared/moe_checkpoints.py). Qwen's released checkpoints and transformers' `save_pretrained`
hold the thinker's experts per expert (`thinker.model.layers.{l}.mlp.experts.{j}.gate_proj.weight` ...;
transformers fuses them on load through qwen2_moe's mapping); fused checkpoints, in either orientation,
load too, and an export writes the layout its input had. Only the thinker's experts are checked and
converted: the talker's are carried through untouched (spindle.train.tasks.omni.copy_untrained)."""

from __future__ import annotations

from spindle.models.shared.moe_checkpoints import PER_EXPERT, ExpertCheckpoints

ADAPTER = ExpertCheckpoints(
    model_type="qwen3_omni_moe_thinker",  # the root: its class-name mapping renames thinker.* to the model's names
    sub_model_types=("qwen3_omni_moe_text",),  # the decoder's mapping converts the experts
    default_layout=PER_EXPERT,
    transposed_fused=True,
    layers_prefix="thinker.model.layers",
    key_prefix="thinker.",
)
