"""Qwen3.5 mixture-of-experts models (transformers `model_type` "qwen3_5_moe",
`Qwen3_5MoeForConditionalGeneration`): Qwen3.5's vision tower, 3-D RoPE and hybrid Gated DeltaNet + full-attention
decoder with a sparse MoE in every layer (routed experts fused as the model holds them, plus a gated shared
expert that stays dense), trained by the VLM task with its experts part (conversion.py selects it: router aux
loss, expert load, expert parallelism). As for `qwen3_5`, packing is refused for the linear-attention layers
and Ulysses SP splits their heads (spindle/models/qwen3_5/__init__.py says how)."""

from spindle.contracts.family import VLMFamily
from spindle.models.qwen3_5 import FAMILY as QWEN3_5

FAMILY = VLMFamily(
    name="qwen3_5_moe",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss (patches.py)
    model_class="spindle.models.qwen3_5_moe.generated.patched_modeling_qwen3_5_moe:Qwen3_5MoeForConditionalGeneration",
    parts=QWEN3_5.parts,
    video_timestamps=True,
)
