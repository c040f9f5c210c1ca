"""Qwen2.5-VL vision-language models (transformers `model_type` "qwen2_5_vl",
`Qwen2_5_VLForConditionalGeneration`), trained by the VLM task on image/video conversations."""

from spindle.contracts.family import VLMFamily

FAMILY = VLMFamily(
    name="qwen2_5_vl",
    # patchgen-generated: the chunked loss from hidden states (patches.py)
    model_class="spindle.models.qwen2_5_vl.generated.patched_modeling_qwen2_5_vl:Qwen2_5_VLForConditionalGeneration",
)
