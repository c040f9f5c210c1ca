"""Qwen3-VL-MoE vision-language models (transformers `model_type` "qwen3_vl_moe",
`Qwen3VLMoeForConditionalGeneration`): Qwen3-VL's vision tower, 3-D RoPE and deepstack over a Qwen3-MoE
style decoder, trained by the VLM task with its experts part (conversion.py selects it: router aux loss, expert
load, expert parallelism). Its checkpoints hold the experts fused and transposed (`gate_up_proj
[E, H, 2I]`); per-expert checkpoints load too, and an export keeps the input's layout (conversion.py).
Videos as Qwen3-VL's (timestamps in the text)."""

from spindle.contracts.family import VLMFamily
from spindle.models.qwen3_vl import FAMILY as QWEN3_VL

FAMILY = VLMFamily(
    name="qwen3_vl_moe",
    # patchgen-generated: chunked loss from hidden states + upstream's router aux loss (patches.py)
    model_class="spindle.models.qwen3_vl_moe.generated.patched_modeling_qwen3_vl_moe:Qwen3VLMoeForConditionalGeneration",
    parts=QWEN3_VL.parts,  # Qwen3-VL's vision tower, deepstack mergers and decoder names
    video_timestamps=True,  # Qwen3-VL's video processing
)
