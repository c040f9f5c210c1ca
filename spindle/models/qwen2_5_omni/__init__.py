"""Qwen2.5-Omni (transformers `model_type` "qwen2_5_omni", `Qwen2_5OmniForConditionalGeneration`): the omni task
trains its thinker (`Qwen2_5OmniThinkerForConditionalGeneration`: audio encoder, vision tower, decoder) on
audio/image/video conversations; the talker and token2wav are carried through to the export unchanged."""

from spindle.contracts.family import OmniFamily

FAMILY = OmniFamily(
    name="qwen2_5_omni",
    # patchgen-generated: the chunked loss from hidden states (patches.py)
    model_class="spindle.models.qwen2_5_omni.generated.patched_modeling_qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration",
    full_model_class="transformers:Qwen2_5OmniForConditionalGeneration",
    untrained=("talker.", "token2wav."),
    blocks=("Qwen2_5OmniDecoderLayer", "Qwen2_5OmniVisionBlock", "Qwen2_5OmniAudioEncoderLayer"),
)
