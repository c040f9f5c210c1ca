"""Qwen2.5-Omni (transformers `model_type` "qwen2_5_omni", `Qwen2_5OmniForConditionalGeneration`): the omni task
trains its thinker (`Qwen2_5OmniThinkerForConditionalGeneration`: audio encoder, vision tower, decoder) on
audio/image/video conversations; the talker and token2wav are carried through to the export unchanged."""

from spindle.contracts.family import OmniFamily

FAMILY = OmniFamily(
    name="qwen2_5_omni",
    model_class="transformers:Qwen2_5OmniThinkerForConditionalGeneration",
    full_model_class="transformers:Qwen2_5OmniForConditionalGeneration",
    untrained=("talker.", "token2wav."),
    blocks=("Qwen2_5OmniDecoderLayer", "Qwen2_5OmniVisionBlock", "Qwen2_5OmniAudioEncoderLayer"),
)
