"""Qwen3-VL vision-language models (transformers `model_type` "qwen3_vl", `Qwen3VLForConditionalGeneration`),
trained by the VLM task on image and video conversations (videos as its processor makes them: each temporal
patch's timestamp written into the text, spindle.data.video_timestamps)."""

from spindle.contracts.family import VLMFamily

FAMILY = VLMFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    # patchgen-generated: the chunked loss from hidden states (patches.py)
    model_class="spindle.models.qwen3_vl.generated.patched_modeling_qwen3_vl:Qwen3VLForConditionalGeneration",
    parts={
        "vision": ("model.visual.",),
        "aligner": ("model.visual.merger.", "model.visual.deepstack_merger_list."),
        "language": ("model.language_model.", "lm_head."),
    },
    video_timestamps=True,
)
